"""The one way inference requests are parsed and authenticated: `UserBody(Model)`.

    async def create_embeddings(request: Request,
                                body: Annotated[EmbeddingCreate, UserBody(EmbeddingCreate)])

`UserBody` is a dependency on the bare `Request` alone: it checks the user key, takes the
body (`request_body`: as the ingress read it, else from the connection now) and validates it
with `model_validate_json` (pydantic's JSON parser, one pass), after refusing a body nested
deeper than `MAX_JSON_DEPTH` (a 400 naming the limit); `parse_json_body` is the same bounded
reading for routes that take a body of no fixed model (the webhook, `/rerank`'s dispatch).
FastAPI's own body fields and header parameters would parse the JSON into a dict first and
validate that, and solve a sub-dependency per header; on the hot routes (many small embedding
and rerank requests) that machinery costs about as much event-loop time as everything else the
route does, on cores the model needs. A malformed body gets a 400 naming the field, as
FastAPI's own validation does here; `openapi_body` documents the model as the route's request body.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from hub.api.deps import hub_of
from hub.api.ingress import ROUTE_KEY_HEADER, head_of, read_body
from hub.errors import BadRequest
from hub.outcome import ClientGone
from hub.usage.caller import note_caller
from registry.bounded_json import JsonTooDeep, loads_bounded, too_deep

Body = TypeVar("Body", bound=BaseModel)


def credentials(request: Request) -> tuple[str | None, str | None]:
    """The request's `Authorization` and `X-API-Key` headers, as the ingress read them."""
    head = head_of(request.scope)
    if head is not None:
        return head.authorization, head.api_key
    return request.headers.get("authorization"), request.headers.get("x-api-key")


async def read_user_body(request: Request, model: type[Body]) -> Body:
    """The validated body of an inference request, after the user-key check."""
    head = head_of(request.scope)
    if head is not None and head.caller is not None:
        # The ingress checked the key: the caller this request is metered under (hub.usage).
        note_caller(head.caller)
    else:  # no ingress, or it found no valid key: this check raises the 401
        note_caller(await hub_of(request).auth.check(*credentials(request), admin=False))
    raw = await request_body(request)
    if too_deep(raw):
        raise BadRequest(str(JsonTooDeep("the request body")), param="body")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        # FastAPI's own shape (locations under "body"), so the validation handler words it the same.
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)],
            body=raw,
        ) from None


async def request_body(request: Request) -> bytes:
    """The body of `request`: the bytes the ingress read (raising what stopped it reading
    them: `RequestTooLarge`, a client gone), else read from the connection now (kept in the
    head, so a second call returns the same bytes)."""
    head = head_of(request.scope)
    if head is None:
        return await request.body()
    if head.error is not None:
        raise head.error
    if head.body is None:
        # As the ingress reads it, without Starlette's stream wrapped around each message.
        head.body = await read_body(request.receive)
    return head.body


def parse_json_body(raw: bytes, what: str = "the request body") -> Any:
    """The JSON value of `raw`: a 400 (`BadRequest`, param "body") when it is not JSON or is
    nested deeper than `MAX_JSON_DEPTH`; never a RecursionError."""
    try:
        return loads_bounded(raw, what)
    except JsonTooDeep as e:
        raise BadRequest(str(e), param="body") from None
    except ValueError as e:  # UnicodeDecodeError included
        raise BadRequest(f"{what} is not JSON: {e}", param="body") from None


def UserBody(model: type[Body]) -> Any:
    """The dependency marker of an inference route's body: `Annotated[M, UserBody(M)]`."""

    async def user_body(request: Request) -> Body:
        return await read_user_body(request, model)

    return Depends(user_body)


def route_key_of(request: Request) -> str | None:
    """The caller's sticky routing key for traffic splits (`X-Hub-Route-Key`), if any."""
    return request.headers.get(ROUTE_KEY_HEADER)


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


def openapi_body(model: type[BaseModel], *, route_key: bool = False) -> dict[str, Any]:
    """`openapi_extra` documenting `model` as the JSON request body of a route (and the
    `X-Hub-Route-Key` header, for routes that follow a traffic split)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})
    extra: dict[str, Any] = {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _inline(schema, defs)}},
        }
    }
    if route_key:
        extra["parameters"] = [
            {
                "name": "X-Hub-Route-Key",
                "in": "header",
                "required": False,
                "schema": {"type": "string"},
                "description": "sticky routing key: keeps a caller on one version of a split",
            }
        ]
    return extra


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
