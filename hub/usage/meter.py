"""Usage written to SQL by group commit, before each answer's last bytes.

Every request's counts are added to the pending batch in memory (one entry per caller,
model, version and hour); one writer task at a time writes the pending batch in one
transaction on a thread of its own (registry.usage: an upsert by increment) while the next
batch gathers, so under load each transaction carries every request that finished during
the previous one, and a request waits at most about two transactions.

A request waits for its batch at most `commit_timeout`; its answer then goes out in any case
and the counts stay queued. A write is never abandoned: its thread runs until the database
answers or its own timeouts end it (the engine of `registry.replicas.membership_engine`),
and only a write that failed puts its counts back, so nothing is counted twice. While the
database fails, answers stop waiting, counts accumulate in memory and the writer retries
every `retry_interval` (logging once when it starts failing and once when it recovers).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from hub.sql_worker import consume, failure_reason
from hub.usage.metrics import UsageMetrics
from registry.usage import UsageBook, UsageCounts, UsageKey, UsageQuery, UsageTotal, hour_of

log = logging.getLogger(__name__)


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class UsageMeter:
    """This replica's usage writer.

    Contract: `record(...)` adds a request's counts to the next commit and returns once that
    commit landed, failed, or `commit_timeout` passed (at once with `wait=False`, or while
    the database is failing); counts are never dropped while the process lives, and are
    written exactly once when the database answers. `stop()` writes what is still pending
    (waiting at most `stop_timeout`). `totals(query)` reads the sums on the same thread,
    bounded by `sql_timeout`."""

    def __init__(
        self,
        book: UsageBook,
        metrics: UsageMetrics,
        *,
        commit_timeout: float,
        retry_interval: float,
        sql_timeout: float,
        stop_timeout: float = 10.0,
        clock: Callable[[], dt.datetime] = _utcnow,
    ) -> None:
        self.book = book
        self.metrics = metrics
        self.commit_timeout = commit_timeout
        self.retry_interval = retry_interval
        self.sql_timeout = sql_timeout
        self.stop_timeout = stop_timeout
        self.clock = clock
        self._pending: dict[UsageKey, UsageCounts] = {}
        self._writing: dict[UsageKey, UsageCounts] = {}
        # Resolved when the pending batch's write ends: True committed, False failed.
        self._committed: asyncio.Future[bool] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._failing = False
        self._stopped = False
        # One thread: writes follow each other, reads wait behind them (read-your-writes).
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="usage-sql")
        metrics.unwritten.set_function(lambda: self.unwritten_requests)

    @property
    def failing(self) -> bool:
        """Whether the last write failed (answers do not wait for commits meanwhile)."""
        return self._failing

    @property
    def unwritten_requests(self) -> int:
        """Requests whose usage is not committed yet: queued for the next write, kept while
        the database fails, or in the write under way."""
        batches = [self._pending, self._writing]
        return sum(c.requests for batch in batches for c in batch.values())

    async def record(
        self, key: str, model: str, version: int, counts: UsageCounts, *, wait: bool = True
    ) -> None:
        """Meter one request of caller `key` answered by `model` version `version`."""
        self.metrics.count(key, model, counts)
        if self._stopped:  # a request that outlived the shutdown: nothing writes any more
            log.error("usage of a request that ended after shutdown is not written")
            return
        row = UsageKey(key, model, version, hour_of(self.clock()))
        queued = self._pending.get(row)
        if queued is None:
            self._pending[row] = UsageCounts(**counts.as_dict())
        else:
            queued.add(counts)
        if self._committed is None:
            self._committed = asyncio.get_running_loop().create_future()
        committed = self._committed
        if self._writer is None:
            self._writer = asyncio.create_task(self._write(), name="usage commit")
        if not wait or self._failing:
            return
        try:
            async with asyncio.timeout(self.commit_timeout):
                await asyncio.shield(committed)
        except TimeoutError:
            self.metrics.waits_timed_out.inc()

    async def _write(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch, self._pending = self._pending, {}
                committed, self._committed = self._committed, None
                self._writing = batch
                try:
                    # Not bounded here: the engine's own timeouts end a write, and whether
                    # an abandoned one landed would be unknown.
                    await asyncio.shield(loop.run_in_executor(self._thread, self.book.add, batch))
                except Exception as e:
                    self._writing = {}
                    self._put_back(batch)
                    _resolve(committed, False)
                    self.metrics.commits.labels("failed").inc()
                    if not self._failing:
                        log.warning(
                            "usage could not be written: %s; counting in memory and retrying "
                            "every %.1fs", failure_reason(e, "usage.sql_timeout"),
                            self.retry_interval,
                        )  # fmt: skip
                    self._failing = True
                    await asyncio.sleep(self.retry_interval)
                    continue
                self._writing = {}
                _resolve(committed, True)
                self.metrics.commits.labels("ok").inc()
                if self._failing:
                    log.info("usage is written again")
                    self._failing = False
        finally:
            self._writer = None

    def _put_back(self, batch: dict[UsageKey, UsageCounts]) -> None:
        for row, counts in batch.items():
            queued = self._pending.get(row)
            if queued is None:
                self._pending[row] = counts
            else:
                queued.add(counts)

    async def totals(self, query: UsageQuery) -> list[UsageTotal]:
        """The sums `query` asks for, from SQL (raises when it does not answer in time)."""
        future = asyncio.get_running_loop().run_in_executor(self._thread, self.book.totals, query)
        future.add_done_callback(consume)
        async with asyncio.timeout(self.sql_timeout):
            return await asyncio.shield(future)

    async def stop(self) -> None:
        """Write what is pending (at most `stop_timeout`); what could not be is logged."""
        self._stopped = True
        writer = self._writer
        if writer is not None:
            await asyncio.wait({writer}, timeout=self.stop_timeout)
            writer.cancel()  # still retrying a database that does not answer
        if self.unwritten_requests:
            log.error("usage of %d requests could not be written before shutdown",
                      self.unwritten_requests)  # fmt: skip
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.book.engine.dispose()


def _resolve(future: asyncio.Future[bool] | None, committed: bool) -> None:
    if future is not None and not future.done():
        future.set_result(committed)
