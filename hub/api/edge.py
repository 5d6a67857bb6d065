"""Refusal at the HTTP edge: a process too busy to take more work answers 503 at once.

Admission control in the model queues (backends/admission.py) bounds the wait for a forward
pass, but a request costs the process CPU before it gets there: its body is received, parsed
and validated, its route and version resolved, and all of that, for every request, runs on
one event loop. Under a burst that loop falls behind: every request, admitted ones included
(their answers need the loop too), waits for the backlog ahead of it. A refusal made here,
before anything of the request is routed, costs a small fraction of that. The middleware is
the outermost layer of the app (`HubApp`), outside even FastAPI's own error and telemetry
wrappers.

`EdgeLimitMiddleware` refuses a new request, with 503 + `Retry-After` in OpenAI's error shape,
counted in `hub_requests_shed_total{reason}`:

- `event_loop_lag`: the event loop has been busy without a break for more than
  `max_event_loop_lag` (a tick scheduled every few milliseconds is that late): the requests
  already in its backlog will take that long and more (model and version empty);
- `in_progress`: `max_requests_in_progress` requests are in progress in the process, from the
  call of the ASGI app until the last byte of the response (a stream counts until it ends;
  model and version empty);
- `queue_time`: the model it names was refused for queue time a moment ago and its queue is
  still estimated over `max_queue_time_ms` (hub/saturation.py): the same answer its queue
  would give, without the body's validation and the routing (labelled with the model and
  version, and in `hub_requests_total` / `hub_request_seconds` under the path's endpoint, as
  the queue's own refusal is). Only while some model is in that state does the edge look at
  a request: the model of an inference path (`/models/{name}/...`, or `model` in the JSON
  body of the OpenAI- and Cohere-shaped routes, up to `PEEK_BYTES`), the body then handed on
  unchanged;
  only for a route of the model's kind and a caller the authenticator already knows (else
  the route's own 400 or 401 answers, and nothing about the model's load is said).

Probes and metrics are exempt: a saturated process must still say it is alive, and still be
observable.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backends.shed_metrics import ShedMetrics
from hub.api.errors import error_body
from hub.saturation import Saturated

# Never refused: liveness/readiness probes and Prometheus scrapes.
EXEMPT_PREFIXES = ("/health", "/metrics")
# Seconds a refused client should wait: a backlog at this edge drains within about a second
# on the hardware the hub targets, and a later retry only spreads a burst thinner.
EDGE_RETRY_AFTER = 1
REASONS = ("event_loop_lag", "in_progress")
# The inference routes the edge finds a model in, each with the model kind it serves and
# the `endpoint` label its requests are counted under (hub.serving): those whose JSON body
# names the model (`model`), and the per-model paths `/models/{name}/{action}`.
BODY_ROUTES = {
    "/v1/embeddings": ("embedder", "embeddings"),
    "/v1/rerank": ("reranker", "rerank"),
    "/v2/rerank": ("reranker", "rerank"),
    "/rerank": ("reranker", "rerank"),
    "/v1/completions": ("llm", "completions"),
    "/v1/chat/completions": ("llm", "chat"),
    "/v1/responses": ("llm", "responses"),
}
MODEL_ROUTES = {
    "embed": ("embedder", "embeddings"),
    "rerank": ("reranker", "rerank"),
    "generate": ("llm", "generate"),
}
# The largest body read here to find the model: bursts are of small requests; a longer body
# goes on unread.
PEEK_BYTES = 64 * 1024


class LoopLag:
    """How far the event loop is behind: how late a tick scheduled every INTERVAL seconds
    is now. Near 0 while the loop keeps up; as long as the backlog so far when it does not.
    Read at a request's arrival, so it needs no tick to have run since the backlog began.
    The ticks run on the loop of the latest request (test clients each run their own) and
    stop once no request has been seen for IDLE_AFTER seconds: an idle hub never wakes."""

    INTERVAL = 0.01
    IDLE_AFTER = 2.0

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_tick = 0.0
        self._last_request = 0.0

    def seconds(self) -> float:
        """The lag now, in seconds; call on the event loop."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        self._last_request = now
        if loop is not self._loop:  # first request, another loop, or ticks stopped when idle
            self._loop, self._last_tick = loop, now
            loop.call_later(self.INTERVAL, self._tick, loop)
            return 0.0
        return max(0.0, now - self._last_tick - self.INTERVAL)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._loop:
            return  # the ticks of a loop no longer served
        now = time.monotonic()
        self._last_tick = now
        if now - self._last_request > self.IDLE_AFTER:
            self._loop = None
            return
        loop.call_later(self.INTERVAL, self._tick, loop)


class EdgeLimitMiddleware:
    """Pure ASGI, outermost. `max_in_progress` 0 or `max_lag` 0 turns that bound off. The
    count of requests in progress is touched on the event loop only (a plain int)."""

    def __init__(self, app: ASGIApp, max_in_progress: int, max_lag: float) -> None:
        self.app = app
        self.max_in_progress = max_in_progress
        self.max_lag = max_lag
        self.in_progress = 0
        self._lag = LoopLag()
        self._shed: ShedMetrics | None = None
        self._model_shed: dict[tuple[str, int], ShedMetrics] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(EXEMPT_PREFIXES):
            await self.app(scope, receive, send)
            return
        refusal = self._refusal()
        if refusal is not None:
            reason, message = refusal
            if self._shed is None:
                self._shed = _shed_metrics(scope, "", "", REASONS)
            if self._shed is not None:
                self._shed.observe(reason)
            message += f"; retry after {EDGE_RETRY_AFTER}s or send fewer concurrent requests"
            await _refuse(send, message, EDGE_RETRY_AFTER)
            return
        hub = _hub(scope)
        if hub is not None and hub.saturation and scope["method"] == "POST":
            name, receive = await _requested_model(scope, receive)
            saturated = hub.saturation.refusal(name) if name is not None else None
            # The route's kind must be the model's (else its 400 is the answer), and the
            # caller allowed (else its 401): a refusal here says how loaded the model is.
            if (
                saturated is not None
                and saturated.kind == _route_of(scope["path"])[0]
                and hub.auth.known_user(*_credentials(scope))
            ):
                await self._refuse_saturated(scope, send, saturated)
                return
        self.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_progress -= 1

    def _refusal(self) -> tuple[str, str] | None:
        """(reason, message) when a new request must be refused now."""
        if self.max_lag > 0:
            lag = self._lag.seconds()
            if lag > self.max_lag:
                return "event_loop_lag", (
                    f"the hub is overloaded: its event loop is {lag:.2f}s behind, more than "
                    f"max_event_loop_lag ({self.max_lag:g}s)"
                )
        if 0 < self.max_in_progress <= self.in_progress:
            return "in_progress", (
                f"the hub is overloaded: {self.in_progress} requests are in progress in this "
                f"process (setting max_requests_in_progress)"
            )
        return None

    async def _refuse_saturated(self, scope: Scope, send: Send, saturated: Saturated) -> None:
        key = (saturated.model, saturated.version)
        metrics = self._model_shed.get(key)
        if metrics is None:
            labels = (saturated.model, str(saturated.version))
            metrics = _shed_metrics(scope, *labels, ("queue_time",))
            if metrics is not None:
                self._model_shed[key] = metrics
        if metrics is not None:
            metrics.observe("queue_time")
        hub = _hub(scope)
        if hub is not None:  # an answered request like any other, in the model's series
            endpoint = _route_of(scope["path"])[1]
            answered = (saturated.model, str(saturated.version), endpoint)
            hub.metrics.requests.labels(*answered, "503").inc()
            hub.metrics.request_seconds.labels(*answered).observe(0.0)
        message = (
            f"{saturated.message} (refused at the HTTP edge: a request a moment ago found "
            "the same queue, still estimated over its bound)"
        )
        await _refuse(send, message, saturated.retry_after, version=str(saturated.version))


async def _requested_model(scope: Scope, receive: Receive) -> tuple[str | None, Receive]:
    """The bare model name an inference request names (None: another path, a version named
    with `@`, a body too long or not JSON), and the `receive` to hand on: the body read here
    is given again, in the same messages, before anything more."""
    path: str = scope["path"]
    parts = path.split("/")
    if len(parts) == 4 and parts[1] == "models" and parts[3] in MODEL_ROUTES:
        return parts[2] or None, receive
    if path not in BODY_ROUTES:
        return None, receive
    declared = _content_length(scope)
    if declared is None or declared > PEEK_BYTES:
        return None, receive
    messages: list[Message] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        size += len(message.get("body", b""))
        if not message.get("more_body", False) or size > PEEK_BYTES:
            break
    replay = _replay(messages, receive)
    if size > PEEK_BYTES or messages[-1].get("more_body", False):
        return None, replay
    try:
        body = json.loads(b"".join(m.get("body", b"") for m in messages))
    except Exception:  # not JSON, too deeply nested, ...: the route's own parsing answers
        return None, replay
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or "@" in model:
        return None, replay
    return model, replay


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None
    return None


def _hub(scope: Scope) -> Any:
    """The hub the app serves (there once the lifespan built it), or None."""
    return getattr(scope["app"].state, "hub", None) if "app" in scope else None


def _route_of(path: str) -> tuple[str, str]:
    """The model kind and endpoint label of a path `_requested_model` found a model in."""
    return BODY_ROUTES.get(path) or MODEL_ROUTES[path.rsplit("/", 1)[-1]]


def _credentials(scope: Scope) -> tuple[str | None, str | None]:
    """The Authorization and X-API-Key headers."""
    authorization = api_key = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            authorization = value.decode("latin-1")
        elif name == b"x-api-key":
            api_key = value.decode("latin-1")
    return authorization, api_key


def _shed_metrics(
    scope: Scope, model: str, version: str, reasons: tuple[str, ...]
) -> ShedMetrics | None:
    """A counter of refusals, on the hub's registry (there once the lifespan built it): the
    edge's own reasons without a model, or a model's `queue_time` (the series its queue
    counts its own refusals in)."""
    hub = _hub(scope)
    if hub is None:
        return None
    return ShedMetrics(hub.metrics.registry, model, version, reasons)


async def _refuse(send: Send, message: str, retry_after: float, *, version: str = "") -> None:
    wait = max(1, round(retry_after))
    body = json.dumps(error_body(message, "service_unavailable", None, "overloaded")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(wait).encode()),
    ]
    if version:
        headers.append((b"x-hub-model-version", version.encode()))
    # The unread body (at most max_request_body_bytes) is discarded by the server, so the
    # connection stays usable: closing it would make a retrying client pay a new handshake.
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})
