"""Forwarding one HTTP request to a peer replica and passing its answer back as it comes.

The request goes out as it came in (method, path, query, body, the caller's headers but the
hop-by-hop ones) plus two hop headers: `X-Hub-Forwarded-By` (who forwarded it: the peer
serves it itself, whatever it holds, so a request is forwarded at most once) and
`X-Hub-Route` (the version the first replica routed to, so the peer does not route again).
The answer comes back status, headers and body chunk by chunk: a server-sent-event stream
reaches the caller as the peer writes it. The peer's answer names the version
(`X-Hub-Model-Version`) and the replica that served it (`X-Hub-Replica`).

Hop headers are obeyed only when a peer signed them (`HopSigner`): `X-Hub-Hop-Signature`
carries the time of forwarding and an HMAC-SHA256, keyed with `replica.hop_secret`, of the
method, the path with its query, the SHA-256 of the body, both hop headers and that time.
A hop header that is unsigned, signed with another key, or signed more than
`HOP_MAX_SKEW` seconds away from this replica's clock is ignored: the request is a
client's like any other (routed, placed and authenticated as such). A replica without the
secret signs nothing and trusts nothing.

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

import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from starlette.types import Message, Scope, Send

from hub.errors import Unavailable
from hub.routing import Route
from hub.settings import ReplicaSettings

log = logging.getLogger(__name__)

FORWARDED_BY = "X-Hub-Forwarded-By"
ROUTE_HEADER = "X-Hub-Route"
SIGNATURE_HEADER = "X-Hub-Hop-Signature"
REPLICA_HEADER = "X-Hub-Replica"
# How far a hop's signing time may be from this replica's clock (either way): forwarding
# takes milliseconds, pods' clocks are kept by NTP, and a captured request cannot be
# replayed for longer than this.
HOP_MAX_SKEW = 30.0
# Ignored hop headers are logged at most this often per reason (the metric counts each).
LOG_EVERY = 60.0

# RFC 9110 7.6.1 hop-by-hop headers, plus what the client library sets for the new request.
_HOP = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length",
    }
)  # fmt: skip
_HOP_ANSWER = _HOP - {b"content-length"}
_FORWARDED_BY, _ROUTE = FORWARDED_BY.lower().encode(), ROUTE_HEADER.lower().encode()
_SIGNATURE = SIGNATURE_HEADER.lower().encode()
_OURS = frozenset({_FORWARDED_BY, _ROUTE, _SIGNATURE})

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
    """What a request forwarded by a peer says of itself, its signature checked: `by`, the
    replica that forwarded it; `route`, the `X-Hub-Route` value it decided (None: not named)."""

    by: str
    route: str | None


class HopSigner:
    """Signs the hop headers of requests this replica forwards and checks those of requests
    it receives, with `secret` (None: signs nothing, trusts nothing; `enabled` is False).
    `clock` gives wall-clock seconds (the peers' clocks are compared); `refused(reason)` is
    called for each hop header ignored: `unsigned`, `no_secret`, `bad_signature`, `stale`."""

    def __init__(
        self,
        secret: str | None,
        *,
        clock: Callable[[], float] = time.time,
        refused: Callable[[str], None] | None = None,
    ) -> None:
        self._key = secret.encode() if secret else None
        self._clock = clock
        self.refused = refused
        self._logged: dict[str, float] = {}  # reason -> when it was last logged (monotonic)

    @classmethod
    def for_settings(cls, settings: ReplicaSettings) -> HopSigner:
        secret = settings.hop_secret
        return cls(secret.get_secret_value() if secret is not None else None)

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def sign(
        self, method: str, target: bytes, body: bytes, by: str, route: str | None
    ) -> str | None:
        """The `X-Hub-Hop-Signature` value for a request to `target` (its raw path with
        `?query`); None without a secret."""
        if self._key is None:
            return None
        at = f"{self._clock():.3f}"
        return f"t={at},v1={self._mac(self._key, method, target, body, by, route, at)}"

    def verify(
        self, method: str, target: bytes, body: bytes, by: str, route: str | None, value: str | None
    ) -> bool:
        """Whether `value` signs these hop headers, recently, with this replica's secret."""
        reason = self._problem(method, target, body, by, route, value)
        if reason is None:
            return True
        now = time.monotonic()
        if now - self._logged.get(reason, -LOG_EVERY) >= LOG_EVERY:  # a flood logs one line
            self._logged[reason] = now
            log.warning("hop headers (%s %r) of a request to %s ignored: %s", FORWARDED_BY, by,
                        target.decode("latin-1"), _REASONS[reason])  # fmt: skip
        if self.refused is not None:
            self.refused(reason)
        return False

    def _problem(
        self, method: str, target: bytes, body: bytes, by: str, route: str | None, value: str | None
    ) -> str | None:
        if self._key is None:
            return "no_secret"
        if not value:
            return "unsigned"
        fields = dict(part.partition("=")[::2] for part in value.split(","))
        at, mac = fields.get("t", ""), fields.get("v1", "")
        try:
            when = float(at)
        except ValueError:
            return "bad_signature"
        expected = self._mac(self._key, method, target, body, by, route, at)
        if not hmac.compare_digest(mac.encode(), expected.encode()):
            return "bad_signature"
        if not abs(self._clock() - when) <= HOP_MAX_SKEW:
            return "stale"
        return None

    @staticmethod
    def _mac(
        key: bytes, method: str, target: bytes, body: bytes, by: str, route: str | None, at: str
    ) -> str:
        digest = hashlib.sha256(body).hexdigest().encode()
        message = b"\n".join([
            b"hub-hop-v1", method.upper().encode(), target, digest,
            _raw(by), _raw(route or ""), at.encode(),
        ])  # fmt: skip
        return hmac.new(key, message, hashlib.sha256).hexdigest()


_REASONS = {
    "no_secret": "replica.hop_secret is not set here, so no hop is trusted",
    "unsigned": f"no {SIGNATURE_HEADER}",
    "bad_signature": f"{SIGNATURE_HEADER} does not match (is replica.hop_secret the same on "
    "every replica?)",
    "stale": f"signed more than {HOP_MAX_SKEW:g}s away from this replica's clock",
}


def _text(header: bytes) -> str:
    """A header value as text that `_raw` turns back into the same bytes, whatever they are."""
    return header.decode("utf-8", "surrogateescape")


def _raw(text: str) -> bytes:
    """The bytes of a header value: what `Forwarder.forward` sends, what `_text` read."""
    return text.encode("utf-8", "surrogateescape")


def claims_hop(scope: Scope) -> bool:
    """Whether the request carries `X-Hub-Forwarded-By` (signed or not: see `incoming_hop`)."""
    return any(name == _FORWARDED_BY for name, _ in scope["headers"])


def request_target(scope: Scope) -> bytes:
    """The raw path of the request with `?query`, as a signature covers it."""
    path: bytes = scope.get("raw_path") or scope["path"].encode()
    query: bytes = scope.get("query_string", b"")
    return path + b"?" + query if query else path


def incoming_hop(scope: Scope, body: bytes, signer: HopSigner) -> Hop | None:
    """The hop headers of a request a peer forwarded here, `body` its whole body; None when
    it came from a client, or its hop headers are not signed by a peer (`HopSigner.verify`).
    The one place a request's incoming hop headers are read; `Forwarder.forward` is the one
    place they are written."""
    by = route = signature = None
    for name, value in scope["headers"]:
        if name == _FORWARDED_BY:
            by = _text(value)
        elif name == _ROUTE:
            route = _text(value)
        elif name == _SIGNATURE:
            signature = _text(value)
    if not by:
        return None
    target = request_target(scope)
    if not signer.verify(scope["method"], target, body, by, route, signature):
        return None
    return Hop(by, route)


def hop_headers(
    signer: HopSigner, method: str, target: str, body: bytes, by: str, route: str | None = None
) -> dict[str, str]:
    """The hop headers a peer `by` sends with a request to `target` (a path, with its query),
    signed: what `Forwarder.forward` adds, for a client that acts as a replica (tests)."""
    headers = {FORWARDED_BY: by}
    if route is not None:
        headers[ROUTE_HEADER] = route
    signature = signer.sign(method, httpx.URL(target).raw_path, body, by, route)
    if signature is not None:
        headers[SIGNATURE_HEADER] = signature
    return headers


class Forwarder:
    """Sends requests to peers over one pooled httpx client; `close()` on shutdown.

    Contract: `forward` either passes the peer's whole answer to `send` (returns normally,
    also when the answer was cut mid-way: the caller's response is then incomplete), or
    raises `PeerUnreachable` having sent nothing, or `PeerTimeout` having sent nothing."""

    def __init__(
        self, settings: ReplicaSettings, replica_id: str, signer: HopSigner | None = None
    ) -> None:
        self.replica_id = replica_id
        self.settings = settings
        self.signer = signer if signer is not None else HopSigner.for_settings(settings)
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
        url = address + request_target(scope).decode("latin-1")
        headers = [(k, v) for k, v in scope["headers"] if k not in _HOP and k not in _OURS]
        named = route_header(route) if route is not None else None
        headers.append((FORWARDED_BY.encode(), self.replica_id.encode()))
        if named is not None:
            headers.append((ROUTE_HEADER.encode(), named.encode()))
        request = self.client.build_request(scope["method"], url, headers=headers, content=body)
        # Signed as it goes out: the peer checks the path it receives, as httpx sends it.
        signature = self.signer.sign(
            scope["method"], request.url.raw_path, body, self.replica_id, named
        )
        if signature is not None:
            request.headers[SIGNATURE_HEADER] = signature
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
