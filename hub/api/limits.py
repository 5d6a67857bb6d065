"""A maximum request body, enforced before the body is read.

`BodyLimitMiddleware` answers 413 in the error shape at once when `Content-Length` says the
body is larger than `max_request_body_bytes` (nothing of it is read), and counts the bytes of
bodies sent without a length (chunked): past the limit, reading stops and the route gets
`RequestTooLarge`, which the error handlers answer as the same 413. A body is never buffered
past the limit, so a 1 GB upload costs the hub no more than the limit.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hub.api.errors import error_body
from hub.errors import HubError
from hub.units import format_bytes


class RequestTooLarge(HubError, StarletteHTTPException):  # type: ignore[misc]  # headers: dict vs Mapping
    """The request body is over the configured maximum (413). An HTTPException too, so that
    FastAPI's body parsing passes it on instead of calling it a malformed body."""

    status_code = 413
    error_type = "invalid_request_error"

    def __init__(self, limit: int, size: int | None = None) -> None:
        size_text = f" ({format_bytes(size)})" if size is not None else ""
        message = (
            f"the request body{size_text} is over the hub's maximum of {format_bytes(limit)} "
            "(setting max_request_body_bytes); send less per request, e.g. split the inputs"
        )
        # Both bases' fields, set directly: HubError's __init__ would reach HTTPException's
        # through the MRO with the wrong arguments.
        StarletteHTTPException.__init__(self, 413, message)
        self.message, self.param, self.code, self.headers = message, None, "request_too_large", {}


class BodyLimitMiddleware:
    """Pure ASGI: no response streaming or background tasks are wrapped."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared == -1:
            await _answer(send, 400, "Content-Length is not a byte count", "invalid_header")
            return
        if declared is not None and declared > self.max_bytes:
            error = RequestTooLarge(self.max_bytes, declared)
            await _answer(send, 413, error.message, error.code)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise RequestTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited, send)


def _content_length(scope: Scope) -> int | None:
    """The declared length; None when absent, -1 when it is not a number."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            if not (text.isascii() and text.isdigit() and len(text) <= 18):
                return -1
            return int(text)
    return None


async def _answer(send: Send, status: int, message: str, code: str | None) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                # The unread body is still on the connection: do not reuse it.
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
