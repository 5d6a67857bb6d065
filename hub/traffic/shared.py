"""Traffic statistics shared by every replica through SQL.

Each replica counts its own traffic in memory (hub.traffic.stats) and, every
`traffic.stats_flush_interval`, writes the tallies that changed into its rows of
`hub_traffic_stats` (registry.traffic_stats): cumulative numbers, so a flush that failed or
timed out is simply repeated by the next one, and a database outage only delays them (the
numbers keep accumulating in memory). Readouts and canaries read `totals`: the other
processes' flushed rows plus this process's live tallies, so on one replica nothing lags.

SQL never runs on the event loop: calls go to two threads of their own and are abandoned
after `traffic.sql_timeout` (the engine's own timeouts end the thread, see
`registry.replicas.membership_engine`); while a flush is outstanding the next is skipped.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

from hub.periodic import PeriodicSync, Write
from hub.sql_worker import SqlWorker, failure_reason
from hub.traffic.histogram import LatencyHistogram, Tally
from hub.traffic.metrics import TrafficMetrics
from hub.traffic.stats import TallyKey, TrafficStats
from registry.traffic_stats import TrafficStatsBook, VersionTraffic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Totals:
    """A model's traffic summed over replicas for revisions `revisions` (the last is the
    current policy revision): tallies by (version label, revision), the replicas that
    contributed, and whether the other replicas' rows could be read (`shared`)."""

    revision: int
    revisions: range
    tallies: dict[tuple[str, int], Tally] = field(default_factory=dict)
    replicas: list[str] = field(default_factory=list)
    shared: bool = True

    def labels(self) -> set[str]:
        return {label for label, _ in self.tallies}

    def arm(self, label: str, *, current_only: bool = True) -> Tally:
        """`label`'s tally in the current revision, or over every revision read."""
        return Tally.total(
            t
            for (lb, rev), t in self.tallies.items()
            if lb == label and (rev == self.revision or not current_only)
        )


class SharedStats(PeriodicSync):
    """This replica's side of `hub_traffic_stats`: the flush loop and summed reads.

    Contract: `start()` starts flushing every `interval`; `stop()` flushes once more and
    stops; `flush()` writes what changed (False when it failed or one is still outstanding,
    counted in `hub_traffic_stats_flushes_total`); `totals(model, ...)` never raises for a
    database outage: it answers with this replica's numbers and `shared=False`."""

    task_name = "traffic stats flush"
    outage_log = "traffic statistics flush failed: %(reason)s; retrying every %(interval).1fs"
    recovery_log = "traffic statistics flushes succeed again"
    timeout_setting = "traffic.sql_timeout"

    def __init__(
        self,
        stats: TrafficStats,
        book: TrafficStatsBook,
        metrics: TrafficMetrics,
        *,
        replica: str,
        interval: float,
        sql: SqlWorker,
    ) -> None:
        # `sql`: the traffic service's worker (hub.traffic.service), shared with the canary
        # lease on an engine apart from the hub's main pool, so a busy pool never delays a
        # flush and an outage fails it fast.
        super().__init__(interval=interval, sql=sql)
        self.stats = stats
        self.book = book
        self.metrics = metrics
        self.replica = replica
        # Unique per process start: a restarted replica adds rows, never overwrites.
        self.incarnation = uuid.uuid4().hex

    async def tick(self, instant: float) -> None:
        await self.flush()

    async def final_write(self) -> None:
        await self.flush()  # the last seconds of a clean shutdown are not lost

    def count(self, step: str, outcome: str) -> None:
        self.metrics.stats_flushes.labels(outcome).inc()
        if outcome == "ok":
            self.metrics.stats_last_flush.set(time.time())

    async def flush(self) -> bool:
        def collect() -> Write | None:
            changed = self.stats.changed()
            if not changed:
                return None
            entries = [_entry(key, tally) for key, tally in changed.items()]
            replica, incarnation = self.replica, self.incarnation
            # Cumulative numbers: a failed flush's keys are written again by the next one,
            # with what came since, and never counted twice.
            return (
                lambda: self.book.flush(replica, incarnation, entries),
                lambda: self.stats.unflushed(changed),
            )

        return await self.write_step("flush", collect)

    async def totals(self, model: str, *, revisions: int, local_revision: int) -> Totals:
        """`model`'s traffic in its last `revisions` policy revisions, summed over replicas.
        When the database does not answer, this replica's own numbers at `local_revision`
        (its catalog's) with `shared=False`."""
        incarnation = self.incarnation
        try:
            read = await self.sql.call(
                lambda: self.book.read(model, revisions=revisions, exclude_incarnation=incarnation)
            )
        except Exception as e:
            log.warning(
                "could not read %s's shared traffic statistics: %s",
                model,
                failure_reason(e, "traffic.sql_timeout"),
            )
            window = range(local_revision - revisions + 1, local_revision + 1)
            local = self.stats.tallies(model, window)
            contributed = [self.replica] if any(t.requests for t in local.values()) else []
            return Totals(local_revision, window, local, contributed, shared=False)
        window = range(read.revision - revisions + 1, read.revision + 1)
        tallies = self.stats.tallies(model, window)
        replicas = {self.replica} if any(t.requests for t in tallies.values()) else set()
        for row in read.rows:
            key = (row.label, row.revision)
            tallies[key] = tallies.get(key, Tally()).merge(_tally(row))
            if row.requests:
                replicas.add(row.replica)
        return Totals(read.revision, window, tallies, sorted(replicas))


def _entry(key: TallyKey, tally: Tally) -> VersionTraffic:
    model, label, revision = key
    return VersionTraffic(
        model=model,
        label=label,
        revision=revision,
        requests=tally.requests,
        routed=tally.routed,
        errors=tally.errors,
        tokens=tally.tokens,
        busy_s=tally.busy_s,
        latency=tally.latency.to_json(),
    )


def _tally(row: VersionTraffic) -> Tally:
    return Tally(
        requests=row.requests,
        routed=row.routed,
        errors=row.errors,
        tokens=row.tokens,
        busy_s=row.busy_s,
        latency=LatencyHistogram.from_json(row.latency),
    )
