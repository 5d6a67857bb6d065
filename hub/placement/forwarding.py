"""Forwarding one HTTP request to a peer replica and passing its answer back as it comes.

The request goes out as it came in (method, path, query, body, the caller's headers but the
hop-by-hop ones) plus two hop headers: `X-Hub-Forwarded-By` (who forwarded it: the peer
serves it itself, whatever it holds, so a request is forwarded at most once) and
`X-Hub-Route` (the version the first replica routed to, so the peer does not route again).
The answer comes back status, headers and body chunk by chunk: a server-sent-event stream
reaches the caller as the peer writes it. The peer's answer names the version
(`X-Hub-Model-Version`) and the replica that served it (`X-Hub-Replica`).

Failures, by when they happen:
- before the peer answered anything (connection refused, reset, closed: it just died, or a
  pooled connection to it went stale): `PeerUnreachable`, and the caller may send the request
  elsewhere, since nothing reached the client yet and inference has no side effects;
- no answer within `replica.forward_timeout`: `PeerTimeout` (a 503 with Retry-After: the peer
  may still be working on it, so it is not sent a second time);
- after the answer started: it is cut short (the client sees a truncated body), counted
  as `broken`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import httpx
from starlette.types import Message, Scope, Send

from hub.errors import Unavailable
from hub.routing import Route
from hub.settings import ReplicaSettings

log = logging.getLogger(__name__)

FORWARDED_BY = "X-Hub-Forwarded-By"
ROUTE_HEADER = "X-Hub-Route"
REPLICA_HEADER = "X-Hub-Replica"

# RFC 9110 7.6.1 hop-by-hop headers, plus what the client library sets for the new request.
_HOP = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length",
    }
)  # fmt: skip
_HOP_ANSWER = _HOP - {b"content-length"}
_FORWARDED_BY, _ROUTE = FORWARDED_BY.lower().encode(), ROUTE_HEADER.lower().encode()
_OURS = frozenset({_FORWARDED_BY, _ROUTE})

# Connections kept open to peers (keep-alive), and the most opened at once.
POOL_CONNECTIONS = 256


class PeerUnreachable(Exception):
    """The peer sent nothing back: the request may be served elsewhere."""


class PeerTimeout(Unavailable):
    """The peer did not answer in time (503 with Retry-After)."""


def route_header(route: Route) -> str:
    """`name@version`, then `;pinned` when the caller named the version, `;split` when the
    split chose it and `;via=<public name>` when the split sent a public name to another
    model's version (see `Route`)."""
    value = f"{route.name}@{route.version}"
    if route.pinned:
        value += ";pinned"
    if route.split:
        value += ";split"
    if route.via:
        value += f";via={route.via}"
    return value


def parse_route_header(value: str) -> tuple[str, str, bool, str | None, bool]:
    """(name, version reference, split, via, pinned) of an `X-Hub-Route` value; ValueError
    if it is not one."""
    first, *flags = value.split(";")
    name, sep, ref = first.strip().partition("@")
    if not (name and sep and ref):
        raise ValueError(f"{ROUTE_HEADER} {value!r} is not name@version")
    split, via, pinned = False, None, False
    for flag in flags:
        key, _, arg = flag.strip().partition("=")
        if key == "pinned":
            pinned = True
        elif key == "split":
            split = True
        elif key == "via" and arg:
            via = arg
    return name, ref, split, via, pinned


@dataclass(frozen=True)
class Hop:
    """What a request forwarded by a peer says of itself: `by`, the replica that forwarded
    it; `route`, the `X-Hub-Route` value it decided (None: not named)."""

    by: str
    route: str | None


def incoming_hop(scope: Scope) -> Hop | None:
    """The hop headers of a request a peer forwarded here (None: it came from a client).
    The one place a request's incoming hop headers are read; `Forwarder.forward` is the one
    place they are written."""
    by = route = None
    for name, value in scope["headers"]:
        if name == _FORWARDED_BY:
            by = value.decode("latin-1")
        elif name == _ROUTE:
            route = value.decode("latin-1")
    return Hop(by, route) if by else None


class Forwarder:
    """Sends requests to peers over one pooled httpx client; `close()` on shutdown.

    Contract: `forward` either passes the peer's whole answer to `send` (returns normally,
    also when the answer was cut mid-way: the caller's response is then incomplete), or
    raises `PeerUnreachable` having sent nothing, or `PeerTimeout` having sent nothing."""

    def __init__(self, settings: ReplicaSettings, replica_id: str) -> None:
        self.replica_id = replica_id
        self.settings = settings
        connect = settings.forward_connect_timeout
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.forward_timeout, connect=connect, pool=connect),
            limits=httpx.Limits(
                max_connections=POOL_CONNECTIONS, max_keepalive_connections=POOL_CONNECTIONS
            ),
            follow_redirects=False,
            trust_env=False,  # peers are reached directly, never through an HTTP(S)_PROXY
        )

    async def close(self) -> None:
        await self.client.aclose()

    async def forward(
        self, address: str, scope: Scope, body: bytes, route: Route | None, send: Send
    ) -> int:
        """Forward the request of `scope` (its body already read) to the replica at
        `address`, naming `route` (None: not an inference request); returns the peer's
        status."""
        query = scope.get("query_string", b"")
        path: bytes = scope.get("raw_path") or scope["path"].encode()
        url = address + path.decode("latin-1") + (("?" + query.decode("latin-1")) if query else "")
        headers = [(k, v) for k, v in scope["headers"] if k not in _HOP and k not in _OURS]
        headers.append((FORWARDED_BY.encode(), self.replica_id.encode()))
        if route is not None:
            headers.append((ROUTE_HEADER.encode(), route_header(route).encode()))
        request = self.client.build_request(scope["method"], url, headers=headers, content=body)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TimeoutException as e:
            if not isinstance(e, httpx.ReadTimeout | httpx.WriteTimeout):
                raise PeerUnreachable(f"{address}: {type(e).__name__}") from e
            raise PeerTimeout(
                f"replica {address} did not answer within replica.forward_timeout "
                f"({self.settings.forward_timeout:g}s); retry shortly",
                retry_after=self.settings.heartbeat_interval,
            ) from e
        except httpx.TransportError as e:  # refused, reset, closed before any answer
            raise PeerUnreachable(f"{address}: {type(e).__name__}: {e}") from e
        try:
            await send(_start(response))
            try:
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError as e:
                # The answer started: nothing to fall back to. Returning without the final
                # message makes the server close the connection: the caller sees it cut.
                log.warning("replica %s broke off its answer to %s: %s", address, url, e)
                raise ForwardBroken(str(e)) from e
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()
        return response.status_code


class ForwardBroken(Exception):
    """The peer's answer had started and then failed; the caller got part of it."""


def _start(response: httpx.Response) -> Message:
    # The body passes through byte for byte (not decoded), so its length still holds.
    headers = [(k, v) for k, v in response.headers.raw if k.lower() not in _HOP_ANSWER]
    return {"type": "http.response.start", "status": response.status_code, "headers": headers}
