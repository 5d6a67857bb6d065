"""Refusal at the HTTP edge: a process too busy to take more work answers 503 at once.

Admission control in the model queues (backends/admission.py) bounds the wait for a forward
pass, but a request costs the process CPU before it gets there: its body is received, parsed
and validated, its route and version resolved, and all of that, for every request, runs on
one event loop. Under a burst that loop falls behind: every request, admitted ones included
(their answers need the loop too), waits for the backlog ahead of it. A refusal made here,
before anything of the request is read or routed, costs a small fraction of that.

`EdgeLimitMiddleware` refuses a new request, with 503 + `Retry-After` in OpenAI's error shape,
counted in `hub_requests_shed_total{reason}` (model and version empty: no model was chosen):

- `event_loop_lag`: the event loop has been busy without a break for more than
  `max_event_loop_lag` (a tick scheduled every few milliseconds is that late): the requests
  already in its backlog will take that long and more;
- `in_progress`: `max_requests_in_progress` requests are in progress in the process, from the
  call of the ASGI app until the last byte of the response (a stream counts until it ends).

Probes and metrics are exempt: a saturated process must still say it is alive, and still be
observable.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from backends.batch_metrics import ShedMetrics
from hub.api.errors import error_body

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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(EXEMPT_PREFIXES):
            await self.app(scope, receive, send)
            return
        refusal = self._refusal()
        if refusal is not None:
            reason, message = refusal
            if self._shed is None:
                self._shed = _shed_metrics(scope)
            if self._shed is not None:
                self._shed.observe(reason)
            await _refuse(send, message)
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


def _shed_metrics(scope: Scope) -> ShedMetrics | None:
    """The counter of refusals, on the hub's registry (there once the lifespan built it)."""
    hub: Any = getattr(scope["app"].state, "hub", None) if "app" in scope else None
    if hub is None:
        return None
    return ShedMetrics(hub.metrics.registry, "", "", REASONS)


async def _refuse(send: Send, reason: str) -> None:
    message = f"{reason}; retry after {EDGE_RETRY_AFTER}s or send fewer concurrent requests"
    body = json.dumps(error_body(message, "service_unavailable", None, "overloaded")).encode()
    # The unread body (at most max_request_body_bytes) is discarded by the server, so the
    # connection stays usable: closing it would make a retrying client pay a new handshake.
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(EDGE_RETRY_AFTER).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
