"""Background tasks: `cancel_and_wait` for every stop, and `PeriodicSync`, the shape of a
replica's periodic sync through SQL (traffic statistics, rate limits).

A sync runs a step every interval on a task of its own. Its blocking SQL runs on the
`SqlWorker` its subclass passes, never on the event loop nor on the hub's main pool, and is
abandoned after that worker's timeout; while a write is outstanding the next one is skipped,
so a database that stopped answering holds one thread, not one per tick. Writes carry
cumulative numbers: one that failed, or whose outcome is unknown, puts its data back and the
next write repeats it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from hub.sql_worker import SqlWorker, failure_reason

# A write's blocking call, and what puts its data back when it failed or may not have landed.
Write = tuple[Callable[[], object], Callable[[], None]]


async def cancel_and_wait(*tasks: asyncio.Task[Any]) -> None:
    """Cancel every task at once, then wait until each has ended. Their own cancellation is
    swallowed; a cancel of the caller while it waits is not. An exception a task ended with
    is raised once every task has ended: as it is when one task failed, in an
    `ExceptionGroup` when several did."""
    for task in tasks:
        task.cancel()
    errors: list[Exception] = []
    for task in tasks:
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
        except Exception as e:
            errors.append(e)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ExceptionGroup("several background tasks ended with an error", errors)


class PeriodicSync(ABC):
    """`tick` every `interval` seconds on a task of its own, from `start()` until `stop()`.

    Contract: with `aligned_to` (a clock), ticks fall on that clock's multiples of
    `interval`, the same instants on every replica; without it, `interval` after the previous
    tick ended. A tick that raises is logged and the next runs as planned. `stop()` waits
    for a write under way (so the last write is not a skip), then runs `final_write`.
    `write_step` runs one blocking write on `sql`; it and the subclass's other steps report
    through `succeeded` / `failed`, which `count` every step's outcome ("ok", "failed",
    "skipped") and log one warning per outage and one line when it ends; none of them
    raises for a database outage.

    A subclass names its task (`task_name`), its log lines (`outage_log`, %-style with
    `step`, `reason` and `interval`; `recovery_log`) and the setting that bounds its SQL
    waits (`timeout_setting`). Its own module's logger writes them."""

    task_name: ClassVar[str]
    outage_log: ClassVar[str]
    recovery_log: ClassVar[str]
    timeout_setting: ClassVar[str]

    def __init__(
        self,
        *,
        interval: float,
        sql: SqlWorker,
        aligned_to: Callable[[], float] | None = None,
    ) -> None:
        self.interval = interval
        self.sql = sql
        self._aligned_to = aligned_to
        self._log = logging.getLogger(type(self).__module__)
        self._pending: asyncio.Future[object] | None = None
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    @abstractmethod
    async def tick(self, instant: float) -> None:
        """One interval's work; `instant` is when it was due (on the aligning clock, else
        the event loop's)."""

    @abstractmethod
    async def final_write(self) -> None:
        """The last write, at `stop()`: what came since the last tick."""

    @abstractmethod
    def count(self, step: str, outcome: str) -> None:
        """Count one `step`'s `outcome` in the subclass's metrics."""

    @property
    def writing(self) -> bool:
        """A write is outstanding: the next one is a skip until it ends."""
        return self._pending is not None and not self._pending.done()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if self._pending is not None and self.writing:
            # A failed write put its data back, so the final write carries it.
            with contextlib.suppress(Exception):
                await self.sql.wait(self._pending)
        await self.final_write()

    async def _run(self) -> None:
        while True:
            instant = await self._next_instant()
            try:
                await self.tick(instant)
            except Exception:  # a bug in one tick must not end the sync for good
                self._log.exception("%s failed; trying again next interval", self.task_name)

    async def _next_instant(self) -> float:
        clock = self._aligned_to
        if clock is None:
            await asyncio.sleep(self.interval)
            return asyncio.get_running_loop().time()
        now = clock()
        instant = (math.floor(now / self.interval) + 1) * self.interval
        await asyncio.sleep(instant - now)
        return instant

    async def write_step(self, step: str, collect: Callable[[], Write | None]) -> bool:
        """Run the write `collect` prepares (None: nothing to write, True) unless the
        previous one is still outstanding (False, counted "skipped"). False when it failed."""
        if self.writing:
            self.count(step, "skipped")
            return False
        write = collect()
        if write is None:
            return True
        call, put_back = write
        future = self.sql.submit(call)
        self._pending = future
        try:
            await self.sql.wait(future)
        except asyncio.CancelledError:
            put_back()  # whether it landed is unknown: the next write repeats it
            raise
        except Exception as e:
            put_back()
            return self.failed(step, e)
        return self.succeeded(step)

    def succeeded(self, step: str) -> bool:
        if self._failing:
            self._log.info(self.recovery_log)
        self._failing = False
        self.count(step, "ok")
        return True

    def failed(self, step: str, e: Exception) -> bool:
        self.count(step, "failed")
        if not self._failing:
            reason = failure_reason(e, self.timeout_setting)
            fields = {"step": step, "reason": reason, "interval": self.interval}
            self._log.warning(self.outage_log, fields)
        self._failing = True
        return False
