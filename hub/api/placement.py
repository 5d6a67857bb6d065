"""The HTTP side of placement: the decisions the ingress (hub.api.ingress) asks for a request.

`place`: for an inference request on a replica with live peers, the request is routed once
(the model's traffic split decides the version here, on the first replica) from the
ingress's head, `Placement` says where that version is served, and the request is either
forwarded or left to the route with the decided version in its head (`Head.route`;
`hub.api.deps.get_router` serves it, so the route does not route again).

`forwarded_route`: a request that a peer forwarded (`X-Hub-Forwarded-By`, read and its
signature checked by hub.placement.forwarding.incoming_hop) is always served here, with the
version its `X-Hub-Route` names. `to_replica`: an admin load, unload, pin or unpin with
`?replica=<id>` naming another live replica is sent there (its admin key checked first, by
the ingress). `tagged`: every answer of this replica, whatever the path, carries
`X-Hub-Replica: <id>`; a forwarded answer keeps the one the peer set.

With placement off, or no live peer, nothing here is asked (one replica behaves as it always
did). A request whose model cannot be read (not JSON, no `model`) or routed is left to the
route, which answers its error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from starlette.types import Message, Receive, Scope, Send

from hub.api.edge import answer_error
from hub.api.keys_access import routes_for
from hub.errors import HubError, NotFound, Unavailable
from hub.periodic import cancel_and_wait
from hub.placement.forwarding import (
    REPLICA_HEADER,
    ROUTE_HEADER,
    Hop,
    PeerUnreachable,
    parse_route_header,
)
from hub.placement.service import Placement
from hub.routing import Route, Router

if TYPE_CHECKING:
    from hub.api.ingress import Head

log = logging.getLogger(__name__)


async def place(hub: Any, head: Head, scope: Scope, receive: Receive, send: Send) -> bool:
    """Route the request of `head` once and serve it where placement decides: True when it
    was answered here (forwarded, or a forwarding error), False when the route serves it
    (with `head.route` set when it was routed)."""
    if head.body is None or not head.parsed or head.model is None:
        return False
    router = routes_for(hub.router, head.caller)
    try:
        route = router.route(head.model, route_key=head.route_key)
    except HubError:  # an unknown model, a bad reference: the route answers the error
        return False
    head.route = route
    placement: Placement = hub.placement
    decision = placement.decide(route)
    if decision.loads and await placement.refresh():
        decision = placement.decide(route)
    placement.metrics.decisions.labels(decision.reason).inc()
    if decision.here and decision.loads:
        placement.announce_soon()
    if decision.here:
        return False
    try:
        forwarding = placement.forward(decision, route, scope, head.body, send)
        # Watching the connection itself: the body stays in the head for the route, should
        # every peer be unreachable.
        return await _unless_client_leaves(forwarding, receive)
    except HubError as e:
        await answer_error(send, e)
        return True


async def forwarded_route(hop: Hop, hub: Any) -> Route | None:
    """The route the forwarding replica decided; None (route here as usual) when it named
    none, or a version this replica's catalog does not have even after catching up."""
    router: Router = hub.router
    route = _named_route(hop.route, router)
    if route is None and hop.route:
        # The forwarding replica knows a version this one has not read yet (it was
        # registered a moment ago): catch up with SQL once rather than answer 404.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await hub.control.refresh()
        route = _named_route(hop.route, router)
    return route


def _named_route(value: str | None, router: Router) -> Route | None:
    if not value:
        return None
    try:
        name, ref, split, via, pinned = parse_route_header(value)
        route = router.route_version(name, ref)
    except (ValueError, HubError) as e:
        log.warning("forwarded request with %s %r routed here instead: %s", ROUTE_HEADER, value, e)
        return None
    return dataclasses.replace(route, pinned=pinned, split=split, via=via)


async def to_replica(
    placement: Placement, target: str, scope: Scope, body: bytes, send: Send
) -> None:
    """An admin load/unload/pin/unpin naming another replica (`?replica=<id>`), its caller
    already authenticated, sent there with its body."""
    peer = placement.peer(target)
    try:
        if peer is None:
            raise NotFound(
                f"replica {target!r} is not live; GET /admin/replicas lists the live ones",
                param="replica",
            )
        try:
            await placement.forwarder.forward(peer.address, scope, body, None, send)
        except PeerUnreachable as e:
            raise Unavailable(f"replica {target!r} did not answer ({e}); retry shortly") from e
    except HubError as e:
        await answer_error(send, e)


def tagged(send: Send, replica_id: str) -> Send:
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
    await cancel_and_wait(forward)
    return True


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
