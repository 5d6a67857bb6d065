"""HTTP requests in flight in the hub, the idle gaps between them, and ways to wait for an
idle or a busy moment: how shadow mirrors stay out of primary requests' way.

A request counts from its arrival until the last byte of its response is sent (an ASGI
middleware), not only while `serve()` holds the model: serialising and writing an answer
needs the CPU too, and a mirror started when `serve()` returns would compete with it. It
counts hub-wide, not per model: on a CPU hub every model's requests share the same cores.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send


class InFlight:
    """Touched only on the event loop."""

    # Idle gaps remembered (few, so a burst after a quiet spell is noticed within a few
    # requests), and how many are needed before they mean anything.
    GAPS_KEPT = 8
    GAPS_NEEDED = 4

    def __init__(self) -> None:
        self._count = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._busy = asyncio.Event()
        self._idle_since: float | None = None
        self._gaps: deque[float] = deque(maxlen=self.GAPS_KEPT)

    @property
    def count(self) -> int:
        return self._count

    def enter(self) -> None:
        if self._count == 0 and self._idle_since is not None:
            self._gaps.append(time.monotonic() - self._idle_since)
        self._count += 1
        self._idle.clear()
        self._busy.set()

    def leave(self) -> None:
        self._count = max(0, self._count - 1)
        if self._count == 0:
            self._idle_since = time.monotonic()
            self._busy.clear()
            self._idle.set()

    def typical_gap(self) -> float | None:
        """Median length (seconds) of the recent idle gaps between requests; None until a
        few were seen."""
        if len(self._gaps) < self.GAPS_NEEDED:
            return None
        return statistics.median(self._gaps)

    async def wait_idle(self, within: float) -> bool:
        """True once no request is in flight; False if `within` seconds passed first."""
        return await _wait(self._idle, within)

    async def wait_busy(self, within: float) -> bool:
        """True once a request is in flight; False if the hub stayed idle `within` seconds."""
        return await _wait(self._busy, within)


async def _wait(event: asyncio.Event, within: float) -> bool:
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(within):
            await event.wait()
    except TimeoutError:
        return False
    return True


class InFlightMiddleware:
    """Counts every HTTP request in the hub's `InFlight` until its response is sent."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hub: Any = getattr(scope["app"].state, "hub", None) if "app" in scope else None
        if scope["type"] != "http" or hub is None:
            await self.app(scope, receive, send)
            return
        in_flight: InFlight = hub.traffic.in_flight
        in_flight.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            in_flight.leave()
