"""The periodic sync through SQL that traffic statistics and rate limits share: an outage
is logged once and lost nothing, a write still under way makes the next one a skip, a stop
writes what came last, and aligned ticks fall on the same instants on every replica.

The "database" is a list the blocking calls append to, on the sync's own threads; threading
events hold a call back where a test needs a write outstanding."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Callable

import pytest

from hub.periodic import PeriodicSync, Write, cancel_and_wait
from hub.sql_worker import SqlWorker

HANG_GUARD = 10.0  # seconds before a test that hangs fails; no timing is asserted


class Sync(PeriodicSync):
    """Writes the numbers added since its last write (cumulative, like the hub's syncs)."""

    task_name = "test sync"
    outage_log = "test sync failed (%(step)s: %(reason)s); retrying every %(interval).2gs"
    recovery_log = "test sync succeeds again"
    timeout_setting = "test.sql_timeout"

    def __init__(self, interval: float, aligned_to: Callable[[], float] | None = None) -> None:
        super().__init__(
            interval=interval, sql=SqlWorker(HANG_GUARD, name="test-sync"), aligned_to=aligned_to
        )
        self.unwritten: list[int] = []
        self.written: list[int] = []  # the database's rows
        self.down = False  # the database refuses writes
        self.hold: threading.Event | None = None  # a write waits for it in its thread
        self.counts: Counter[tuple[str, str]] = Counter()
        self.instants: list[float] = []
        self.ticked = asyncio.Event()
        self.bugs = 0  # how many of the next ticks raise

    async def tick(self, instant: float) -> None:
        self.instants.append(instant)
        self.ticked.set()
        if self.bugs:
            self.bugs -= 1
            raise RuntimeError("a bug")
        await self.write()

    async def final_write(self) -> None:
        await self.write()

    def count(self, step: str, outcome: str) -> None:
        self.counts[step, outcome] += 1

    async def write(self) -> bool:
        def collect() -> Write | None:
            numbers, self.unwritten = self.unwritten, []
            if not numbers:
                return None
            hold = self.hold
            return lambda: self._store(numbers, hold), lambda: self.unwritten.extend(numbers)

        return await self.write_step("write", collect)

    def _store(self, numbers: list[int], hold: threading.Event | None) -> None:
        if hold is not None:
            hold.wait(HANG_GUARD)
        if self.down:
            raise ConnectionRefusedError("the database refuses connections")
        self.written.extend(numbers)

    async def ticks(self, n: int) -> None:
        """Wait until the loop has run `n` more ticks."""
        for _ in range(n):
            self.ticked.clear()
            await asyncio.wait_for(self.ticked.wait(), HANG_GUARD)


async def test_an_outage_is_logged_once_and_the_loop_writes_everything_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sync = Sync(interval=0.001)
    sync.down = True
    sync.unwritten = [1, 2]
    with caplog.at_level(logging.INFO, logger=__name__):
        sync.start()
        await sync.ticks(4)  # each of them failed, and the loop went on
        # No write in its thread while the database comes back (`writing` is a flag of the
        # sync, with no event to wait on).
        while sync.writing:  # noqa: ASYNC110
            await asyncio.sleep(0.001)
        sync.unwritten.append(3)  # traffic goes on during the outage
        sync.down = False
        await sync.ticks(2)
        await sync.stop()
    assert sorted(sync.written) == [1, 2, 3]  # put back by each failure, never doubled
    assert sync.counts["write", "failed"] >= 3
    assert sync.counts["write", "ok"] == 1
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in lines] == ["WARNING", "INFO"]
    assert lines[0][1].startswith("test sync failed (write: ConnectionRefusedError")
    assert lines[1][1] == "test sync succeeds again"
    sync.sql.shutdown()


async def test_a_tick_that_raises_is_logged_and_the_next_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sync = Sync(interval=0.001)
    sync.bugs = 1
    sync.start()
    await sync.ticks(3)
    sync.unwritten.append(7)
    await sync.ticks(2)
    assert sync.written == [7]  # written by the loop, not by stop
    await sync.stop()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in errors] == ["test sync failed; trying again next interval"]
    sync.sql.shutdown()


async def test_a_write_under_way_makes_the_next_a_skip() -> None:
    sync = Sync(interval=3600)
    sync.hold = threading.Event()
    sync.unwritten = [1]
    first = asyncio.create_task(sync.write())
    await asyncio.sleep(0)  # its call is submitted before its first wait
    assert sync.writing
    sync.unwritten.append(2)
    assert await sync.write() is False  # skipped: 2 waits for the next write
    assert sync.counts["write", "skipped"] == 1 and sync.unwritten == [2]
    sync.hold.set()
    assert await first is True and sync.written == [1]
    sync.hold = None
    assert await sync.write() is True and sync.written == [1, 2]
    sync.sql.shutdown()


async def test_stop_waits_for_a_write_under_way_then_writes_what_came_since() -> None:
    sync = Sync(interval=3600)  # no tick: only stop writes
    sync.start()
    hold = sync.hold = threading.Event()
    sync.unwritten = [1]
    first = asyncio.create_task(sync.write())
    await asyncio.sleep(0)  # its call is submitted before its first wait
    assert sync.writing
    sync.hold = None
    sync.unwritten.append(2)  # after the write under way took its numbers
    stopping = asyncio.create_task(sync.stop())
    for _ in range(10):  # enough turns for stop to have skipped, had it not waited
        await asyncio.sleep(0)
    assert not stopping.done()
    hold.set()
    await asyncio.wait_for(stopping, HANG_GUARD)
    assert await first is True
    assert sync.written == [1, 2]
    assert sync.counts["write", "skipped"] == 0
    sync.sql.shutdown()


async def test_aligned_ticks_fall_on_multiples_of_the_interval() -> None:
    readings = iter([7.99, 15.999, 23.95, 31.99])
    sync = Sync(interval=8.0, aligned_to=lambda: next(readings))
    sync.start()
    await sync.ticks(3)
    await sync.stop()
    assert sync.instants == [8.0, 16.0, 24.0]
    sync.sql.shutdown()


async def test_cancel_and_wait_ends_the_task_but_not_a_cancel_of_its_caller() -> None:
    release = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await release.wait()  # clean-up that takes a while

    quick = asyncio.create_task(asyncio.Event().wait())
    await cancel_and_wait(quick)
    assert quick.cancelled()

    slow = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0)
    stopper = asyncio.create_task(cancel_and_wait(slow))
    await asyncio.sleep(0)
    stopper.cancel()  # e.g. a shutdown step that ran out of time
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    assert slow.done()


async def test_cancel_and_wait_stops_every_task_before_it_raises_what_one_ended_with() -> None:
    async def fails_on_cancel(message: str) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError(message) from None

    idle = asyncio.create_task(asyncio.Event().wait())
    broken = asyncio.create_task(fails_on_cancel("one"))
    later = asyncio.create_task(asyncio.Event().wait())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="one"):
        await cancel_and_wait(idle, broken, later)
    assert idle.cancelled() and later.cancelled()

    first = asyncio.create_task(fails_on_cancel("first"))
    second = asyncio.create_task(fails_on_cancel("second"))
    await asyncio.sleep(0)
    with pytest.raises(ExceptionGroup) as group:
        await cancel_and_wait(first, second)
    assert [str(e) for e in group.value.exceptions] == ["first", "second"]
