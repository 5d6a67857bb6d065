"""Bounds on a request's headers, checked first thing in the ingress: 431 past them.

The HTTP parser uvicorn uses by default (httptools) accepts headers of any size and number,
so a 5 MiB header or 100,000 headers reached the routes (and every middleware that walks the
headers) and were answered 200. `header_refusal` sums what the server handed over and
refuses more than `MAX_HEADER_COUNT` headers or `MAX_HEADER_BYTES` of names and values with
431 (Request Header Fields Too Large) in OpenAI's error shape, naming the limit; the
connection is closed after it, as the client is sending something no server takes. `hub
serve` also gives h11 (uvicorn's other parser) the same size bound.
"""

from __future__ import annotations

from starlette.types import Scope

from hub.errors import HubError

# Larger than any browser or SDK sends (nginx's default buffers hold 32 KiB, Node's 16 KiB);
# headers beyond are a mistake or an attack.
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADER_COUNT = 256


class HeadersTooLarge(HubError):
    status_code = 431
    error_type = "invalid_request_error"


def header_refusal(scope: Scope) -> HeadersTooLarge | None:
    """The error to answer when the request's headers exceed the bounds, else None."""
    headers = scope["headers"]
    if len(headers) > MAX_HEADER_COUNT:
        return _refusal(f"the request has {len(headers)} headers; at most {MAX_HEADER_COUNT}")
    size = sum(len(name) + len(value) for name, value in headers)
    if size > MAX_HEADER_BYTES:
        return _refusal(
            f"the request's headers hold {size} bytes; at most {MAX_HEADER_BYTES} are taken"
        )
    return None


def _refusal(message: str) -> HeadersTooLarge:
    return HeadersTooLarge(message, code="headers_too_large", headers={"Connection": "close"})
