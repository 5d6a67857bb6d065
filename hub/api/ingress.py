"""The hub's one HTTP ingress: the outermost ASGI layer, where each request is classified,
its body read at most once, and the decisions made before any route runs.

In order, for an HTTP request:

1. the edge refusal (hub.api.edge): an overloaded process answers 503 at once (probes and
   metrics exempt);
2. the body limit (hub.api.limits) and the count of requests in flight (hub.traffic);
3. for a `POST` to a path of `ROUTES`, a `Head`: the path's `Endpoint` (the model kind it
   serves, the label it is counted under, whether the model is in the path or the body),
   the model as the caller named it, the caller's credentials, the route key and, where a
   decision needs them, the body bytes, read here once under the body limit;
4. the hop check (a request whose hop headers a peer signed is served here, with the
   version they name: hub.placement.forwarding.incoming_hop; unsigned ones are ignored), the
   saturation refusal (a model whose queue is over its bound, for a caller already verified
   whose key may use the model: hub.api.edge), the caller's key check (once: the route and
   the router read `Head.caller`, hub.api.keys_access; a missing or invalid key is the 401
   the route would answer, answered here), its key's rate limits (a 429 before
   anything is routed: hub.rate_limits) and the placement decision
   (hub.api.placement), each from the head; for an admin call naming a replica
   (`?replica=<id>`), the admin key check and then the forwarding there;
5. the route, with the head in the scope (`head_of`): it takes the body from the head
   (hub.api.bodies.request_body) and serves the route decided here, if any
   (hub.api.deps.router_of), so nothing is read or routed twice.

The body is read here only when a decision needs what is in it: the model of a body-named
route while some model is saturated, any inference body while placement is active
(forwarding sends it on), and the body of a request claiming a hop (its signature covers
the body). Otherwise the route reads it, through the same limit. A body that
cannot be read (over the limit, the client gone) or parsed (not JSON) decides nothing here:
the route gives its own answer (413, 400).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import QueryParams
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hub.api.edge import EXEMPT_PREFIXES, Edge, answer_error
from hub.api.header_limits import header_refusal
from hub.api.keys_access import grants_of
from hub.api.limits import BodyLimitMiddleware
from hub.api.placement import forwarded_route, place, tagged, to_replica
from hub.auth import Caller
from hub.errors import HubError, Unauthorized
from hub.placement.forwarding import Hop, claims_hop, incoming_hop
from hub.rate_limits.limiter import RateLimited, RateLimiter, metered
from hub.rate_limits.scopes import counted_models
from hub.routing import Route
from hub.traffic.in_flight import InFlightMiddleware

ROUTE_KEY_HEADER = "x-hub-route-key"
_ROUTE_KEY = ROUTE_KEY_HEADER.encode()
# The scope key under which a request's `Head` reaches its route.
HEAD = "hub.head"


@dataclass(frozen=True)
class Endpoint:
    """What a path is: `serves` the model kind of an inference route (None: an admin call on
    one replica's copy of a version), `label` the `endpoint` its requests are counted under
    (hub.serving), `in_path` whether the path names the model (else the JSON body does)."""

    serves: str | None
    label: str
    in_path: bool


def _model_paths(action: str, kind: str, label: str) -> dict[str, Endpoint]:
    endpoint = Endpoint(kind, label, in_path=True)
    return {f"/models/{{name}}/{action}": endpoint,
            f"/models/{{name}}/versions/{{version}}/{action}": endpoint}  # fmt: skip


# The one route table of the ingress: every path it makes a decision for.
ROUTES: dict[str, Endpoint] = {
    "/v1/embeddings": Endpoint("embedder", "embeddings", in_path=False),
    "/v1/rerank": Endpoint("reranker", "rerank", in_path=False),
    "/v2/rerank": Endpoint("reranker", "rerank", in_path=False),
    "/rerank": Endpoint("reranker", "rerank", in_path=False),
    "/v1/completions": Endpoint("llm", "completions", in_path=False),
    "/v1/chat/completions": Endpoint("llm", "chat", in_path=False),
    "/v1/responses": Endpoint("llm", "responses", in_path=False),
    **_model_paths("embed", "embedder", "embeddings"),
    **_model_paths("rerank", "reranker", "rerank"),
    **_model_paths("generate", "llm", "generate"),
    **{
        f"/admin/models/{{name}}/versions/{{version}}/{action}": Endpoint(None, action, True)
        for action in ("load", "unload", "pin", "unpin")
    },
}
_TEMPLATES = [
    (re.compile(template.format(name="(?P<name>[^/]*)", version="(?P<version>[^/]*)")), e)
    for template, e in ROUTES.items()
    if "{" in template
]


def classify(path: str) -> tuple[Endpoint, str | None] | None:
    """The endpoint of `path` and the model its path names (`name`, or `name@version`; None
    when the body names it, or the name is empty); None for a path not in `ROUTES`."""
    endpoint = ROUTES.get(path)
    if endpoint is not None:
        return endpoint, None
    if not path.startswith(("/models/", "/admin/models/")):
        return None
    for pattern, endpoint in _TEMPLATES:
        match = pattern.fullmatch(path)
        if match is not None:
            name, version = match["name"], match.groupdict().get("version")
            if not name:
                return endpoint, None
            return endpoint, f"{name}@{version}" if version is not None else name
    return None


@dataclass(slots=True)
class Head:
    """What the ingress knows of one inference request before its route runs.

    `model` is the model as the caller named it (the path's, else the body's `model` once
    the body is read; None while unknown); `route_key` the `X-Hub-Route-Key` header, else the
    body's `user`; `hop` its hop headers when a peer signed them (hub.placement.forwarding);
    `body` the bytes read here (None: not read, the route reads them) and
    `parsed` whether they are a JSON object; `error` why they could not be read (the route
    raises it); `route` the version decided here (None: the route routes as usual);
    `caller` who sent it, authenticated here once (None: no valid key, the route answers
    401), whose policy limits the models it may route to (hub.api.keys_access)."""

    endpoint: Endpoint
    model: str | None
    authorization: str | None
    api_key: str | None
    route_key: str | None
    hop: Hop | None = None
    body: bytes | None = None
    parsed: bool = False
    error: Exception | None = None
    route: Route | None = None
    caller: Caller | None = None

    @property
    def bare_model(self) -> str | None:
        """The model when it is a bare name (no version named with `@`)."""
        return self.model if self.model and "@" not in self.model else None

    async def read(self, receive: Receive) -> None:
        """Read the body (under the limit `receive` enforces) and what it names."""
        try:
            self.body = await read_body(receive)
        except Exception as e:  # over the limit, the client gone: the route reports it
            self.error = e
            return
        try:
            fields: Any = json.loads(self.body)
        except (ValueError, RecursionError):  # not JSON, or nested too deep: the route answers
            return
        if not isinstance(fields, dict):
            return
        self.parsed = True
        if not self.endpoint.in_path:
            model = fields.get("model")
            self.model = model if isinstance(model, str) else None
        user = fields.get("user")
        if self.route_key is None and isinstance(user, str):
            self.route_key = user


async def read_body(receive: Receive) -> bytes:
    """The whole body of a request; raises what `receive` raises (`RequestTooLarge` past
    the body limit), and `ClientDisconnect` when the client left before sending it all."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def head_of(scope: Scope) -> Head | None:
    """The head the ingress made for this request (None: not an inference request)."""
    head: Head | None = scope.get(HEAD)
    return head


class Ingress:
    """Pure ASGI, the outermost layer of the app (outside FastAPI's own error and telemetry
    wrappers): a refusal under a burst costs none of them. `max_in_progress` or `max_lag` 0
    turns that edge bound off; `max_body_bytes` is `max_request_body_bytes`."""

    def __init__(
        self, app: ASGIApp, *, max_in_progress: int, max_lag: float, max_body_bytes: int
    ) -> None:
        self.app = app
        self.edge = Edge(max_in_progress, max_lag)
        self._bounded = BodyLimitMiddleware(InFlightMiddleware(self._decide), max_body_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if (too_large := header_refusal(scope)) is not None:
            await answer_error(send, too_large)
            return
        hub = _hub(scope)
        if hub is not None:  # every answer of this replica names it
            send = tagged(send, hub.placement.id)
        if scope["path"].startswith(EXEMPT_PREFIXES):
            await self._bounded(scope, receive, send)
            return
        if await self.edge.refused(hub, send):
            return
        self.edge.in_progress += 1
        try:
            await self._bounded(scope, receive, send)
        finally:
            self.edge.in_progress -= 1

    async def _decide(self, scope: Scope, receive: Receive, send: Send) -> None:
        hub = _hub(scope)
        found = classify(scope["path"]) if scope["method"] == "POST" else None
        if hub is None or found is None:
            await self.app(scope, receive, send)
            return
        endpoint, model = found
        if endpoint.serves is None:
            await self._admin(hub, scope, receive, send)
            return
        head = _head(scope, endpoint, model)
        scope[HEAD] = head
        signer = hub.placement.signer
        claimed = claims_hop(scope)
        placing = hub.placement.active
        # A hop's signature covers the body: a request claiming one is read here to check it.
        if (claimed and signer.enabled) or placing or (not endpoint.in_path and hub.saturation):
            await head.read(receive)
        if claimed and head.error is None:
            head.hop = incoming_hop(scope, head.body or b"", signer)
        # Refused without I/O: only a caller verified already, for a model its key may use.
        if hub.saturation and _may_name(hub.auth.cached(head.authorization, head.api_key), head):
            saturated = self.edge.saturated(hub, head)
            if saturated is not None:
                await self.edge.refuse_saturated(hub, head, send, saturated)
                return
        try:
            head.caller = await hub.auth.check(head.authorization, head.api_key, admin=False)
        except Unauthorized as e:
            # The route's first step (hub.api.bodies.read_user_body) answers the same 401,
            # after FastAPI's routing and dependencies: answered here, before all of that.
            await answer_error(send, e)
            return
        except Exception:  # SQL down: the route answers (503)
            head.caller = None
        caller = head.caller
        # Without limits, or forwarded by a peer (which admitted it): served as it is.
        if caller is None or caller.policy.limits is None or head.hop is not None:
            await self._serve(hub, head, scope, receive, send, placing)
            return
        limits = caller.policy.limits
        # Its length and max_tokens are its cost; the body names the model of most routes.
        needs_body = limits.counts_tokens() or (limits.models and not endpoint.in_path)
        if needs_body and head.body is None:
            await head.read(receive)
        models = counted_models(head.model, hub.catalog.snapshot) if limits.models else ()
        limiter: RateLimiter = hub.limits  # the fleet's buckets (hub.rate_limits)
        try:
            admission = limiter.admit(caller.name, limits, _replicas(hub), head.body, models)
        except RateLimited as e:
            await answer_error(send, e)
            return
        try:
            await self._serve(hub, head, scope, receive, metered(send, admission), placing)
        finally:
            limiter.settle(admission)

    async def _serve(
        self, hub: Any, head: Head, scope: Scope, receive: Receive, send: Send, placing: bool
    ) -> None:
        """Serve an admitted request: with the version a peer decided, forwarded by
        placement (`placing`: placement is active, as the request arrived), or by the
        route."""
        if head.hop is not None:
            head.route = await forwarded_route(head.hop, hub)
        elif placing and head.caller is not None and await place(hub, head, scope, receive, send):
            return
        await self.app(scope, receive, send)

    async def _admin(self, hub: Any, scope: Scope, receive: Receive, send: Send) -> None:
        """An admin load/unload/pin/unpin. With `?replica=<id>` the caller's admin key is
        checked first, before that replica is looked up, then the call is sent to it unless
        it is this one (or a peer signed it over: it was sent here already)."""
        target = QueryParams(scope["query_string"]).get("replica")
        if not target:
            await self.app(scope, receive, send)
            return
        try:
            await hub.auth.check(*_credentials(scope), admin=True)
        except HubError as e:
            await answer_error(send, e)
            return
        if target == hub.placement.id:
            await self.app(scope, receive, send)
            return
        try:
            body = await read_body(receive)
        except HubError as e:
            await answer_error(send, e)
            return
        except ClientDisconnect:  # nobody is left to answer
            return
        hop = incoming_hop(scope, body, hub.placement.signer) if claims_hop(scope) else None
        if hop is None:
            await to_replica(hub.placement, target, scope, body, send)
        else:
            await self.app(scope, _replay(body, receive), send)


def _may_name(caller: Caller | None, head: Head) -> bool:
    """Whether `caller` is known and may use the bare model the head names (a key that may
    not gets the route's 404, never word of that model's load)."""
    if caller is None:
        return False
    grants = grants_of(caller)
    return grants is None or (head.bare_model is not None and grants.names(head.bare_model))


def _replicas(hub: Any) -> int:
    """How many live replicas share each key's `max_concurrent`: this one and its peers."""
    peers = {p.id for p in hub.replicas.peers}
    return len(peers | {hub.placement.id})


def _credentials(scope: Scope) -> tuple[str | None, str | None]:
    """The `Authorization` and `X-API-Key` headers of a request."""
    authorization = api_key = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            authorization = value.decode("latin-1")
        elif name == b"x-api-key":
            api_key = value.decode("latin-1")
    return authorization, api_key


def _head(scope: Scope, endpoint: Endpoint, model: str | None) -> Head:
    route_key = None
    for name, value in scope["headers"]:
        if name == _ROUTE_KEY:
            route_key = value.decode("latin-1") or None
    return Head(endpoint, model, *_credentials(scope), route_key)


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` that first hands over `body`, already read, then passes on what comes."""
    given = False

    async def replaying() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replaying


def _hub(scope: Scope) -> Any:
    """The hub the app serves (there once the lifespan built it), or None."""
    return getattr(scope["app"].state, "hub", None) if "app" in scope else None
