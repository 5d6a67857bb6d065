"""Keep-alive with Ollama's meaning, and the timer that acts on it.

Each request sets how long its model stays resident once idle: a duration, 0 to unload right
after the request, -1 to keep it until pressure or an admin says otherwise; a request that
says nothing sets the model's default. The clock starts when the last request in flight
finishes. Pinned models never expire. Keep-alive says when a model may leave; memory
pressure may still evict an idle model before that (only a pin prevents it), as in Ollama.

`Reaper` is the manager's one timer: it calls `tick()`, which acts on whatever is due and
returns the next deadline, and sleeps until then, `interval` at most, or until `poke()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from hub.periodic import cancel_and_wait

log = logging.getLogger(__name__)

FOREVER = -1.0


def effective_keep_alive(
    requested: float | None, deployment: float | None, default: float
) -> float:
    """Seconds a model stays resident once idle: the last request's, else the deployment's,
    else the manager's; any negative value means forever."""
    for value in (requested, deployment, default):
        if value is not None:
            return FOREVER if value < 0 else value
    return default


class Reaper:
    """The manager's one timer task: runs `tick` at its returned deadline, every `interval`
    at most, or at once after `poke`; a failing tick is logged and the timer goes on."""

    def __init__(self, interval: float, tick: Callable[[], float | None]) -> None:
        self.interval = interval
        self._tick = tick
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if not self.running:
            self._task = asyncio.create_task(self._run(), name="manager-reaper")

    def poke(self) -> None:
        """A deadline moved earlier: re-run `tick` now."""
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                next_at = self._tick()
            except Exception:  # one bad tick must not stop keep-alive for every model
                log.exception("manager timer tick failed")
                next_at = None
            delay = self.interval
            if next_at is not None:
                delay = min(delay, max(0.0, next_at - time.monotonic()))
            self._wake.clear()
            # asyncio.timeout rather than wait_for: wait_for wraps the wait in a task, and a
            # cancel landing as that task completes can leave stop() hanging (CPython 3.11).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
