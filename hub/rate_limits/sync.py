"""Rate limits shared by every replica through SQL: the sync of the limiter's ledger.

Every `interval` (`auth.rate_limit_sync_interval`), at the same wall-clock instants on every
replica (multiples of the interval), each one writes what its limited keys consumed since
the last write (registry.rate_limits: cumulative numbers per key and slot, in rows of its
own), then a moment later (`read_delay`, once the others' writes of that instant are in)
reads the fleet's sums. So what one replica admits reaches the others within about one
interval, and N replicas together admit at most a limit plus what they admit in that time.

SQL never runs on the event loop: calls go to threads of their own, abandoned after
`timeout` (hub.periodic, hub.sql_worker); while a write is outstanding the next is skipped.
A failed write is repeated by the next (the numbers are cumulative); a failed read keeps the
last fleet numbers, which age out of the buckets by themselves. So with the database down
each replica limits on what it knows, and no request ever waits for SQL or fails for it.
"""

from __future__ import annotations

import asyncio
import uuid

from prometheus_client import CollectorRegistry, Counter

from hub.periodic import PeriodicSync, Write
from hub.rate_limits.limiter import RateLimiter
from hub.sql_worker import SqlWorker
from registry.rate_limits import RateLimitBook, SlotSpend

# The longest wait after a write instant before reading the fleet's sums.
MAX_READ_DELAY = 0.1


class LimitSync(PeriodicSync):
    """This replica's side of `hub_rate_limit_spend`.

    Contract: `start()` syncs every `interval`, at the same instants of the limiter's clock
    on every replica, until `stop()`, which writes once more (`close()` then lets go of
    threads and connections); `write()` and `read()` are one step each (False when it failed
    or, for a write, one is still outstanding), counted in
    `hub_rate_limit_syncs_total{step, outcome}`; neither raises for a database outage."""

    task_name = "rate limits sync"
    outage_log = (
        "rate limits' sync through SQL failed (%(step)s: %(reason)s); each replica "
        "limits on what it knows, retrying every %(interval).2gs"
    )
    recovery_log = "the rate limits' sync through SQL succeeds again"
    timeout_setting = "replica.sql_timeout"

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
        # `sql`: a worker of the limits' own (hub.state), with the replica heartbeats' short
        # timeouts, so neither the hub's main pool nor another sync delays these writes.
        super().__init__(interval=interval, sql=sql, aligned_to=lambda: self.limiter.clock())
        self.limiter = limiter
        self.book = book
        self.replica = replica
        # Unique per process start: a restarted replica adds rows, never overwrites.
        self.incarnation = uuid.uuid4().hex
        self.read_delay = min(MAX_READ_DELAY, interval / 4)
        self.syncs = Counter(
            "hub_rate_limit_syncs_total",
            "Steps of the rate limits' sync through SQL, by step (write, read) and outcome "
            "(ok, failed, skipped)",
            ["step", "outcome"],
            registry=metrics,
        )

    def close(self) -> None:
        """Let go of the threads and the database connections (after `stop`)."""
        self.sql.shutdown()
        self.book.engine.dispose()

    async def tick(self, instant: float) -> None:
        await self.write()
        await asyncio.sleep(max(0.0, instant + self.read_delay - self.limiter.clock()))
        await self.read()
        self.limiter.prune()

    async def final_write(self) -> None:
        await self.write()  # what the last requests consumed keeps counting

    def count(self, step: str, outcome: str) -> None:
        self.syncs.labels(step, outcome).inc()

    async def write(self) -> bool:
        """Write this replica's consumption since the last write (and delete expired rows)."""
        ledger = self.limiter.ledger

        def collect() -> Write | None:
            spends = ledger.taken()
            if not spends:
                return None
            replica, incarnation, now = self.replica, self.incarnation, self.limiter.clock()
            return (
                lambda: self.book.write(replica, incarnation, spends, now),
                lambda: ledger.untaken(spends),
            )

        return await self.write_step("write", collect)

    async def read(self) -> bool:
        """Read the other replicas' consumption, replacing what was known of it."""
        incarnation, now = self.incarnation, self.limiter.clock()
        try:
            spends: list[SlotSpend] = await self.sql.call(lambda: self.book.read(incarnation, now))
        except Exception as e:
            return self.failed("read", e)
        self.limiter.ledger.apply(spends)
        return self.succeeded("read")
