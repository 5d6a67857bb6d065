"""The HTTP side of placement: an ASGI middleware in front of the inference routes.

For a `POST` to an inference path (the OpenAI/Cohere routes and `/models/{name}/...`) on a
replica with live peers, it reads the body, routes the request once (the model's traffic
split decides the version here, on the first replica), asks `Placement` where it is served,
and either forwards it or hands it on to the route with the decided version in the scope
(`DECIDED_ROUTE`; `hub.api.deps.get_router` serves it, so the route does not route again).

A request that a peer forwarded (`X-Hub-Forwarded-By`) is always served here, with the
version its `X-Hub-Route` names. An admin load, unload, pin or unpin with `?replica=<id>`
naming another live replica is sent there. Every answer of this replica, whatever the
path, carries `X-Hub-Replica: <id>`; a forwarded answer keeps the one the peer set.

With placement off, or no live peer, requests pass through untouched (one replica behaves
as it always did). Nothing here reads a body that is not routed: a request whose model
cannot be read (not JSON, no `model`) is left to the route, which answers its 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
from collections.abc import Awaitable
from typing import Any

from starlette.datastructures import Headers, QueryParams
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hub.api.bodies import ROUTE_KEY_HEADER
from hub.api.errors import error_body
from hub.errors import HubError, NotFound, Unavailable
from hub.placement.forwarding import (
    DECIDED_ROUTE,
    FORWARDED_BY,
    REPLICA_HEADER,
    ROUTE_HEADER,
    PeerUnreachable,
    parse_route_header,
)
from hub.placement.service import Placement
from hub.routing import Route, Router

log = logging.getLogger(__name__)

_BODY_MODEL_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses",
     "/v1/rerank", "/v2/rerank", "/rerank"}
)  # fmt: skip
_ADMIN_MODEL = re.compile(r"/admin/models/[^/]+/versions/[^/]+/(?:load|unload|pin|unpin)")
_PER_MODEL = re.compile(r"/models/([^/]+)/(?:versions/([^/]+)/)?(?:generate|embed|rerank)")


class PlacementMiddleware:
    """Pure ASGI (a streamed answer passes through unbuffered)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hub = getattr(scope["app"].state, "hub", None)
        if hub is None:  # before the lifespan built it
            await self.app(scope, receive, send)
            return
        placement: Placement = hub.placement
        router: Router = hub.router
        send = _tagged(send, placement.id)
        headers = Headers(scope=scope)
        if scope["method"] == "POST" and _ADMIN_MODEL.fullmatch(scope["path"]):
            target = QueryParams(scope["query_string"]).get("replica")
            if target and target != placement.id and not headers.get(FORWARDED_BY):
                await _to_replica(placement, target, scope, receive, send)
                return
        if scope["method"] != "POST" or not _is_inference(scope["path"]):
            await self.app(scope, receive, send)
            return
        if headers.get(FORWARDED_BY):
            named = headers.get(ROUTE_HEADER)
            route = _forwarded_route(named, router)
            if route is None and named:
                # The forwarding replica knows a version this one has not read yet (it was
                # registered a moment ago): catch up with SQL once rather than answer 404.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(hub.control.refresh(), timeout=5)
                route = _forwarded_route(named, router)
            if route is not None:
                scope[DECIDED_ROUTE] = route
            await self.app(scope, receive, send)
            return
        if not placement.active:
            await self.app(scope, receive, send)
            return
        try:
            body = await _read_body(receive)
        except Exception as e:  # over the body limit, client gone: the route reports it
            await self.app(scope, _raising(e), send)
            return
        replayed = _replay(body, receive)
        route = _route(scope, headers, body, router)
        if route is None:
            await self.app(scope, replayed, send)
            return
        scope[DECIDED_ROUTE] = route
        decision = placement.decide(route)
        if decision.loads and await placement.refresh():
            decision = placement.decide(route)
        placement.metrics.decisions.labels(decision.reason).inc()
        if decision.here and decision.loads:
            placement.announce_soon()
        if not decision.here:
            try:
                forwarding = placement.forward(decision, route, scope, body, send)
                # Watching the connection itself: the body stays in `replayed` for the
                # route, should every peer be unreachable.
                if await _unless_client_leaves(forwarding, receive):
                    return
            except HubError as e:
                await _answer_error(send, e)
                return
        await self.app(scope, replayed, send)


async def _unless_client_leaves(forwarding: Awaitable[bool], receive: Receive) -> bool:
    """Await the forward; if the client disconnects first, cancel it (closing the connection
    to the peer, which then stops the request's work as for any client that leaves) and
    return True: nobody is left to answer."""
    forward = asyncio.ensure_future(forwarding)
    left = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({forward, left}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request cancelled (shutdown): the forward goes with it
        forward.cancel()
        raise
    finally:
        left.cancel()
    if forward.done():
        return forward.result()
    forward.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await forward
    return True


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _to_replica(
    placement: Placement, target: str, scope: Scope, receive: Receive, send: Send
) -> None:
    """An admin load/unload/pin/unpin naming another replica (`?replica=<id>`), sent there."""
    peer = placement.peer(target)
    try:
        if peer is None:
            raise NotFound(
                f"replica {target!r} is not live; GET /admin/replicas lists the live ones",
                param="replica",
            )
        body = await _read_body(receive)
        try:
            await placement.forwarder.forward(peer.address, scope, body, None, send)
        except PeerUnreachable as e:
            raise Unavailable(f"replica {target!r} did not answer ({e}); retry shortly") from e
    except HubError as e:
        await _answer_error(send, e)


def _is_inference(path: str) -> bool:
    return path in _BODY_MODEL_PATHS or _PER_MODEL.fullmatch(path) is not None


def _route(scope: Scope, headers: Headers, body: bytes, router: Router) -> Route | None:
    """The route of this request as the route handler would pick it; None when the request
    names no model we can read or an unknown one (the route answers the error)."""
    try:
        fields: Any = json.loads(body) if body else {}
    except ValueError:
        return None
    if not isinstance(fields, dict):
        return None
    match = _PER_MODEL.fullmatch(scope["path"])
    if match is not None:
        name, version = match.groups()
        model = f"{name}@{version}" if version else name
    else:
        model = fields.get("model")
        if not isinstance(model, str):
            return None
    user = fields.get("user")
    route_key = headers.get(ROUTE_KEY_HEADER) or (user if isinstance(user, str) else None)
    try:
        return router.route(model, route_key=route_key)
    except HubError:
        return None


def _forwarded_route(value: str | None, router: Router) -> Route | None:
    """The route a forwarding replica decided; None (route here as usual) when the header
    is absent or names a version this replica's catalog does not have yet."""
    if not value:
        return None
    try:
        name, ref, split, via, pinned = parse_route_header(value)
        route = router.route_version(name, ref)
    except (ValueError, HubError) as e:
        log.warning("forwarded request with %s %r routed here instead: %s", ROUTE_HEADER, value, e)
        return None
    return dataclasses.replace(route, pinned=pinned, split=split, via=via)


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ConnectionError("the client left before sending its whole request")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body once, then the connection's own messages (a disconnect, for routes that
    watch for a client leaving)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _raising(error: Exception) -> Receive:
    async def receive() -> Message:
        raise error

    return receive


def _tagged(send: Send, replica_id: str) -> Send:
    """`send` adding `X-Hub-Replica` to the answer unless it has one (a peer's)."""
    name, value = REPLICA_HEADER.lower().encode(), replica_id.encode()

    async def tagging(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            if not any(k.lower() == name for k, _ in headers):
                headers.append((name, value))
                message = {**message, "headers": headers}
        await send(message)

    return tagging


async def _answer_error(send: Send, error: HubError) -> None:
    body = json.dumps(error_body(error.message, error.error_type, error.param, error.code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})
