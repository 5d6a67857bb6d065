"""Request bodies, the user check and client disconnects for the hot inference routes,
without FastAPI's per-request dependency solving.

Embedding and rerank traffic is many small requests; FastAPI's dependency machinery (header
parameters, sub-dependencies, body fields) costs about as much event-loop time per request as
everything else the route does, on cores the model needs. These routes take the bare
`Request`, validate the body with the same pydantic model FastAPI would use (so a malformed body
gets the same 400, naming the field), and document that model for OpenAPI via `openapi_body`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from hub.api.deps import get_hub
from hub.state import Hub

ROUTE_KEY_HEADER = "x-hub-route-key"

Body = TypeVar("Body", bound=BaseModel)


async def user_request(request: Request, model: type[Body]) -> tuple[Hub, Body]:
    """The hub and the validated body of an inference request, after the user-key check."""
    hub = await get_hub(request)
    headers = request.headers
    await hub.auth.check(headers.get("authorization"), headers.get("x-api-key"), admin=False)
    raw = await request.body()
    try:
        body = model.model_validate_json(raw)
    except ValidationError as e:
        # FastAPI's own shape (locations under "body"), so the validation handler words it the same.
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)],
            body=raw,
        ) from None
    return hub, body


class ClientGone(Exception):
    """The client disconnected before its answer was ready; nobody will read a response."""


@contextlib.asynccontextmanager
async def cancelled_if_client_leaves(request: Request) -> AsyncIterator[None]:
    """Cancel the block if the client disconnects meanwhile, raising ClientGone: work the
    block waits for is dropped (a backend's queued inputs never reach the model)."""
    task = asyncio.current_task()
    assert task is not None  # always inside a request's task
    gone = False

    async def watch() -> None:
        nonlocal gone
        # The body has been read, so the next message is the disconnect, or none at all.
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()
        raise ClientGone(f"client left {request.url.path} before the answer was ready") from None
    finally:
        watcher.cancel()


def route_key(request: Request) -> str | None:
    """The caller's sticky routing key for traffic splits, if it sent one."""
    return request.headers.get(ROUTE_KEY_HEADER)


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` documenting `model` as the JSON request body of a route."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _inline(schema, defs)}},
        }
    }


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """`node` with its `#/$defs/...` references replaced by the definitions they name (the
    OpenAPI document has no `$defs` section for them to point into)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node
