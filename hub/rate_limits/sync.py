"""Rate limits shared by every replica through SQL: the sync of the limiter's ledger.

Every `interval` (`auth.rate_limit_sync_interval`), at the same wall-clock instants on every
replica (multiples of the interval), each one writes what its limited keys consumed since
the last write (registry.rate_limits: cumulative numbers per key and slot, in rows of its
own), then a moment later (`read_delay`, once the others' writes of that instant are in)
reads the fleet's sums. So what one replica admits reaches the others within about one
interval, and N replicas together admit at most a limit plus what they admit in that time.

SQL never runs on the event loop: calls go to threads of their own, abandoned after
`timeout` (hub.sql_worker); while a write is outstanding the next is skipped. A failed write
is repeated by the next (the numbers are cumulative); a failed read keeps the last fleet
numbers, which age out of the buckets by themselves. So with the database down each replica
limits on what it knows, and no request ever waits for SQL or fails because of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid

from prometheus_client import CollectorRegistry, Counter

from hub.rate_limits.limiter import RateLimiter
from hub.sql_worker import SqlWorker, failure_reason
from registry.rate_limits import RateLimitBook, SlotSpend

log = logging.getLogger(__name__)

# The longest wait after a write instant before reading the fleet's sums.
MAX_READ_DELAY = 0.1


class LimitSync:
    """This replica's side of `hub_rate_limit_spend`.

    Contract: `start()` syncs every `interval` until `stop()`, which writes once more
    (`close()` then lets go of threads and connections);
    `write()` and `read()` are one step each (False when it failed or, for a write, one is
    still outstanding), counted in `hub_rate_limit_syncs_total{step, outcome}`; neither
    raises for a database outage."""

    def __init__(
        self,
        limiter: RateLimiter,
        book: RateLimitBook,
        *,
        replica: str,
        interval: float,
        sql: SqlWorker,
        metrics: CollectorRegistry | None = None,
    ) -> None:
        self.limiter = limiter
        self.book = book
        self.replica = replica
        # Unique per process start: a restarted replica adds rows, never overwrites.
        self.incarnation = uuid.uuid4().hex
        self.interval = interval
        self.read_delay = min(MAX_READ_DELAY, interval / 4)
        self.sql = sql
        self.syncs = Counter(
            "hub_rate_limit_syncs_total",
            "Steps of the rate limits' sync through SQL, by step (write, read) and outcome "
            "(ok, failed, skipped)",
            ["step", "outcome"],
            registry=metrics,
        )
        self._writing: asyncio.Future[int] | None = None
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="rate limits sync")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._writing is not None and not self._writing.done():
            with contextlib.suppress(Exception):
                await self.sql.wait(self._writing)
        await self.write()  # what the last requests consumed keeps counting

    def close(self) -> None:
        """Let go of the threads and the database connections (after `stop`)."""
        self.sql.shutdown()
        self.book.engine.dispose()

    async def _run(self) -> None:
        clock = self.limiter.clock
        while True:
            now = clock()
            instant = (math.floor(now / self.interval) + 1) * self.interval
            await asyncio.sleep(instant - now)
            try:
                await self.write()
                await asyncio.sleep(max(0.0, instant + self.read_delay - clock()))
                await self.read()
                self.limiter.prune()
            except Exception:  # a bug here must not end the sharing for good
                log.exception("the rate limits' sync failed; trying again next interval")

    async def write(self) -> bool:
        """Write this replica's consumption since the last write (and delete expired rows)."""
        if self._writing is not None and not self._writing.done():
            self.syncs.labels("write", "skipped").inc()
            return False
        ledger = self.limiter.ledger
        spends = ledger.taken()
        if not spends:
            return True
        replica, incarnation, now = self.replica, self.incarnation, self.limiter.clock()
        future = self.sql.submit(lambda: self.book.write(replica, incarnation, spends, now))
        self._writing = future
        try:
            await self.sql.wait(future)
        except asyncio.CancelledError:
            ledger.untaken(spends)  # whether it landed is unknown: the next write repeats it
            raise
        except Exception as e:
            ledger.untaken(spends)
            return self._failed("write", e)
        return self._ok("write")

    async def read(self) -> bool:
        """Read the other replicas' consumption, replacing what was known of it."""
        incarnation, now = self.incarnation, self.limiter.clock()
        try:
            spends: list[SlotSpend] = await self.sql.call(lambda: self.book.read(incarnation, now))
        except Exception as e:
            return self._failed("read", e)
        self.limiter.ledger.apply(spends)
        return self._ok("read")

    def _ok(self, step: str) -> bool:
        if self._failing:
            log.info("the rate limits' sync through SQL succeeds again")
        self._failing = False
        self.syncs.labels(step, "ok").inc()
        return True

    def _failed(self, step: str, e: Exception) -> bool:
        self.syncs.labels(step, "failed").inc()
        if not self._failing:
            log.warning("rate limits' sync through SQL failed (%s: %s); each replica limits on "
                        "what it knows, retrying every %.2gs", step,
                        failure_reason(e, "replica.sql_timeout"), self.interval)  # fmt: skip
        self._failing = True
        return False
