"""This replica's heartbeat and the list of live replicas.

Every `replica.heartbeat_interval` the replica writes what it holds (models resident and
warm, with bytes), free bytes per device and its queue depth into its row, and reads back the
live replicas (`peers`, kept for whoever needs them without a database round trip). A clean
shutdown deletes the row; a replica that dies stops being listed `replica.expire_after`
seconds after its last beat.

The heartbeat never blocks the event loop and never waits for the database longer than
`replica.sql_timeout`: the manager's status is read on the loop, the SQL runs on two threads
of its own, and a call that has not returned in time is abandoned (its thread ends when the
database's own timeouts fire, see `registry.replicas`). While one is outstanding, further
beats are skipped, never queued. A database outage only makes heartbeats fail: logged,
counted in `hub_replica_heartbeats_total{outcome="failed"}`, nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from prometheus_client import CollectorRegistry

from hub.errors import Unavailable
from hub.manager import ModelManager
from hub.periodic import cancel_and_wait
from hub.replicas.identity import advertise_url, replica_id
from hub.replicas.metrics import ReplicaMetrics
from hub.replicas.report import build_beat, queue_depth
from hub.settings import HubSettings, ReplicaSettings
from hub.sql_worker import consume, failure_reason
from registry.replicas import ReplicaBeat, ReplicaBook, ReplicaView

log = logging.getLogger(__name__)

T = TypeVar("T")


class MembershipUnavailable(Unavailable):
    """The database did not answer in time: which replicas are live is unknown for now."""


class Membership:
    """This replica's row in `hub_replicas`, kept fresh by a background task.

    `start()` writes the first beat and starts the timer; `stop()` deletes the row. `live()`
    reads the table now (503 `MembershipUnavailable` when the database does not answer in
    time); `peers` is the list the last successful heartbeat read."""

    def __init__(
        self,
        settings: ReplicaSettings,
        replica_id: str,
        address: str,
        book: ReplicaBook,
        report: Callable[[], ReplicaBeat],
        metrics: ReplicaMetrics,
    ) -> None:
        self.settings = settings
        self.id = replica_id
        self.address = address
        self.book = book
        self._report = report
        self.metrics = metrics
        self.peers: list[ReplicaView] = []
        # time.monotonic() of the heartbeat that read `peers`; None before the first.
        self.peers_as_of: float | None = None
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="replica-sql")
        self._pending: asyncio.Future[list[ReplicaView]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._first_beat = True
        self._failing = False
        metrics.info.labels(replica_id, address).set(1)

    @classmethod
    def for_hub(
        cls, settings: HubSettings, manager: ModelManager, registry: CollectorRegistry
    ) -> Membership:
        """Wired to the hub's manager (what the beats report) and metrics registry."""
        rid, address = replica_id(settings), advertise_url(settings)
        book = ReplicaBook(settings.database_url, timeout=settings.replica.sql_timeout)
        metrics = ReplicaMetrics(registry, lambda: queue_depth(manager.status()))

        def report() -> ReplicaBeat:
            return build_beat(
                rid,
                address,
                manager.status(),
                manager.device_status(),
                manager.host_tier_status(),
            )

        return cls(settings.replica, rid, address, book, report, metrics)

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        await self.beat()
        self._task = asyncio.create_task(self._run(), name="replica-heartbeat")

    async def stop(self) -> None:
        """Stop beating and delete this replica's row, so peers stop listing it at once."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        try:
            await self._in_thread(lambda: self.book.leave(self.id))
            log.info("replica %s left the membership table", self.id)
        except Exception as e:  # it expires by itself
            log.warning(
                "could not delete replica %s's row (%s); peers drop it after %.0fs",
                self.id, _reason(e), self.settings.expire_after,
            )  # fmt: skip
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.book.dispose()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval)
            await self.beat()

    # ---- heartbeat ------------------------------------------------------------------------
    async def beat(self) -> bool:
        """Write one heartbeat and refresh `peers`; False (logged, counted) when it failed or
        the previous one has not returned yet."""
        if self._pending is not None and not self._pending.done():
            self.metrics.heartbeats.labels("skipped").inc()
            return False
        try:
            beat = self._report()
        except Exception:  # a bug, not an outage: say so loudly, keep beating
            log.exception("could not read this replica's status for its heartbeat")
            self.metrics.heartbeats.labels("failed").inc()
            return False
        first = self._first_beat
        expire_after = self.settings.expire_after
        future = asyncio.get_running_loop().run_in_executor(
            self._executor, lambda: self.book.beat(beat, restarted=first, expire_after=expire_after)
        )
        future.add_done_callback(consume)
        self._pending = future
        try:
            async with asyncio.timeout(self.settings.sql_timeout):
                peers = await asyncio.shield(future)
        except Exception as e:
            self.metrics.heartbeats.labels("failed").inc()
            if not self._failing:
                log.warning("replica heartbeat failed: %s; retrying every %.0fs",
                            _reason(e), self.settings.heartbeat_interval)  # fmt: skip
            self._failing = True
            return False
        if self._failing:
            log.info("replica heartbeats succeed again (%d live replicas)", len(peers))
        self._failing = False
        self._first_beat = False
        self.peers, self.peers_as_of = peers, time.monotonic()
        self.metrics.heartbeats.labels("ok").inc()
        self.metrics.last_heartbeat.set(time.time())
        self.metrics.live.set(len(peers))
        return True

    # ---- reads ----------------------------------------------------------------------------
    async def live(self) -> list[ReplicaView]:
        """The replicas whose last heartbeat is fresh, read from the database now."""
        expire_after = self.settings.expire_after
        try:
            return await self._in_thread(lambda: self.book.live(expire_after))
        except Exception as e:
            raise MembershipUnavailable(
                f"the database did not answer the replica list ({_reason(e)}); retry shortly",
                retry_after=self.settings.heartbeat_interval,
            ) from e

    async def _in_thread(self, call: Callable[[], T]) -> T:
        future = asyncio.get_running_loop().run_in_executor(self._executor, call)
        future.add_done_callback(consume)
        async with asyncio.timeout(self.settings.sql_timeout):
            return await asyncio.shield(future)


def _reason(e: BaseException) -> str:
    return failure_reason(e, "replica.sql_timeout")
