"""Refusal at the HTTP edge: a process too busy to take more work answers 503 at once.

Admission control in the model queues (backends/admission.py) bounds the wait for a forward
pass, but a request costs the process CPU before it gets there: its body is received, parsed
and validated, its route and version resolved, and all of that, for every request, runs on
one event loop. Under a burst that loop falls behind: every request, admitted ones included
(their answers need the loop too), waits for the backlog ahead of it. A refusal made here,
before anything of the request is routed, costs a small fraction of that. `Edge` holds the
decisions; the hub's ingress (hub.api.ingress), the outermost layer of the app, asks them.

A new request is refused with 503 + `Retry-After` in OpenAI's error shape, counted in
`hub_requests_shed_total{reason}`:

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
  the queue's own refusal is). Decided from the ingress's head of an inference request (the
  model in its path, or in its JSON body), only for a bare model name, a route of the
  model's kind and a caller the authenticator already knows (else the route's own 400 or
  401 answers, and nothing about the model's load is said).

Probes and metrics are exempt: a saturated process must still say it is alive, and still be
observable.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

from starlette.types import Send

from backends.shed_metrics import ShedMetrics
from hub.api.errors import error_body
from hub.api.serving import VERSION_HEADER
from hub.errors import HubError, Unavailable
from hub.saturation import Saturated

if TYPE_CHECKING:
    from hub.api.ingress import Head

# Never refused: liveness/readiness probes and Prometheus scrapes.
EXEMPT_PREFIXES = ("/health", "/metrics")
# Seconds a refused client should wait: a backlog at this edge drains within about a second
# on the hardware the hub targets, and a later retry only spreads a burst thinner.
EDGE_RETRY_AFTER = 1
REASONS = ("event_loop_lag", "in_progress")


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


class Edge:
    """The edge's refusals. `max_in_progress` 0 or `max_lag` 0 turns that bound off.
    `in_progress` is the count of requests in progress, kept by the ingress and touched on
    the event loop only (a plain int). `hub` below is the app's hub, None before the
    lifespan built it (then nothing is counted in metrics)."""

    def __init__(self, max_in_progress: int, max_lag: float) -> None:
        self.max_in_progress = max_in_progress
        self.max_lag = max_lag
        self.in_progress = 0
        self._lag = LoopLag()
        self._shed: ShedMetrics | None = None
        self._model_shed: dict[tuple[str, int], ShedMetrics] = {}
        # By (model, version, endpoint label): the series a queue-time refusal counts in,
        # looked up once (a label lookup takes a lock and a dict walk on every request).
        self._counted: dict[tuple[str, int, str], tuple[ShedMetrics, Any, Any]] = {}
        # By model name: the refusal a remembered saturation answers with, rendered once (the
        # `Saturated` it was rendered for, its headers, its body), while that entry lasts: a
        # burst's refusals of one model all carry the same message.
        self._answers: dict[str, tuple[Saturated, tuple[tuple[bytes, bytes], ...], bytes]] = {}
        self._metrics: Any = None  # the HubMetrics the series above belong to

    async def refused(self, hub: Any, send: Send) -> bool:
        """Answer 503 and return True when a new request must be refused now."""
        refusal = self._refusal()
        if refusal is None:
            return False
        reason, message = refusal
        if hub is not None:
            self._counting_in(hub)
            if self._shed is None:
                self._shed = ShedMetrics(hub.metrics.registry, "", "", REASONS)
            self._shed.observe(reason)
        message += f"; retry after {EDGE_RETRY_AFTER}s or send fewer concurrent requests"
        await _refuse(send, message, EDGE_RETRY_AFTER)
        return True

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

    def saturated(self, hub: Any, head: Head) -> Saturated | None:
        """The remembered queue-time refusal the request of `head` gets now, if any: only
        for a bare model name, on a route of the model's kind (else the route's 400 is the
        answer). The caller must be one the authenticator already knows, whose key may use
        the model (else its 401 or 404): the ingress asks only for such a caller."""
        if not hub.saturation or head.bare_model is None:
            return None
        saturated: Saturated | None = hub.saturation.refusal(head.bare_model)
        if saturated is None or saturated.kind != head.endpoint.serves:
            return None
        return saturated

    async def refuse_saturated(
        self, hub: Any, head: Head, send: Send, saturated: Saturated
    ) -> None:
        self._counting_in(hub)
        counted = self._counted.get((saturated.model, saturated.version, head.endpoint.label))
        if counted is None:
            counted = self._count_saturated(hub, saturated, head.endpoint.label)
        shed, answered, seconds = counted
        shed.observe("queue_time")
        # An answered request like any other, in the model's series.
        answered.inc()
        seconds.observe(0.0)
        answer = self._answers.get(saturated.model)
        if answer is None or answer[0] is not saturated:
            message = (
                f"{saturated.message} (refused at the HTTP edge: a request a moment ago found "
                "the same queue, still estimated over its bound)"
            )
            error = Unavailable(message, retry_after=saturated.retry_after, code="overloaded")
            error.headers[VERSION_HEADER] = str(saturated.version)
            answer = (saturated, *_rendered(error))
            self._answers[saturated.model] = answer
        _, headers, body = answer
        await _send_rendered(send, 503, headers, body)

    def _counting_in(self, hub: Any) -> None:
        """Count in `hub`'s metrics from now on: a new hub (an app whose lifespan ran again,
        as test clients do) has a registry of its own."""
        if self._metrics is not hub.metrics:
            self._metrics, self._shed, self._model_shed, self._counted = hub.metrics, None, {}, {}
            self._answers = {}

    def _count_saturated(
        self, hub: Any, saturated: Saturated, endpoint: str
    ) -> tuple[ShedMetrics, Any, Any]:
        key = (saturated.model, saturated.version)
        shed = self._model_shed.get(key)
        if shed is None:
            labels = (saturated.model, str(saturated.version))
            shed = self._model_shed[key] = ShedMetrics(
                hub.metrics.registry, *labels, ("queue_time",)
            )
        answered = (saturated.model, str(saturated.version), endpoint)
        counted = (
            shed,
            hub.metrics.requests.labels(*answered, "503"),
            hub.metrics.request_seconds.labels(*answered),
        )
        self._counted[(saturated.model, saturated.version, endpoint)] = counted
        return counted


async def _refuse(send: Send, message: str, retry_after: float) -> None:
    error = Unavailable(message, retry_after=retry_after, code="overloaded")
    # The unread body (at most max_request_body_bytes) is discarded by the server, so the
    # connection stays usable: closing it would make a retrying client pay a new handshake.
    await answer_error(send, error)


async def answer_error(send: Send, error: HubError) -> None:
    """Answer `error` in OpenAI's error shape, with its status and headers, from the ingress
    (before any route and FastAPI's own error handlers)."""
    await _send_rendered(send, error.status_code, *_rendered(error))


async def _send_rendered(
    send: Send, status: int, headers: tuple[tuple[bytes, bytes], ...], body: bytes
) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _rendered(error: HubError) -> tuple[tuple[tuple[bytes, bytes], ...], bytes]:
    """`error`'s answer headers and JSON body (a tuple of headers: the layers that add one
    copy them, so one rendering may answer many requests)."""
    body = json.dumps(error_body(error.message, error.error_type, error.param, error.code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    return tuple(headers), body
