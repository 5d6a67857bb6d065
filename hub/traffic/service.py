"""Versioned routing's moving parts for one hub, and the hooks `serve()` calls.

The router picks a version (hub.routing); everything after that lives here: fault
injection, per-version tallies (hub.traffic.stats) flushed to SQL for every replica to add
up (hub.traffic.shared), the shadow mirror queue (hub.traffic.shadow), and the canary
controller (hub.traffic.canary) with its analyst lease (hub.traffic.analyst). `serve()` calls
`begin` before acquiring the model, `inject_faults` next, and `finish` when the request is
over; routes add tokens and mirror material through the request's `ServedRequest`.
"""

from __future__ import annotations

import datetime as dt
import random
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from hub.control import Control
from hub.manager import ModelManager
from hub.promotion import Promoter
from hub.routing import Route
from hub.settings import TrafficSettings
from hub.sql_worker import SqlWorker
from hub.traffic.analyst import AnalystLease
from hub.traffic.canary import CanaryController
from hub.traffic.faults import FaultInjector, Timer
from hub.traffic.in_flight import InFlight
from hub.traffic.metrics import TrafficMetrics
from hub.traffic.request import ServedRequest
from hub.traffic.shadow import MirrorJob, ShadowMirror
from hub.traffic.shared import SharedStats
from hub.traffic.stats import TrafficStats
from registry.leases import LeaseBook
from registry.replicas import membership_engine
from registry.traffic_stats import TrafficStatsBook
from registry.views import RegistrySnapshot, TrafficPolicyView


class TrafficService:
    """One hub's versioned-routing machinery after the router: faults, samples, shadow
    mirrors, canaries.

    Contract: `serve()` calls `begin(route)` when a request starts (it decides whether the
    request is mirrored and returns its `ServedRequest`), `inject_faults(route)` before the
    model is acquired, and `finish(request, ...)` exactly once when it is over; a request
    answered with a 5xx counts as an error in the readout, a cancelled one is not recorded.
    Samples are counted under the policy revision that routed them; a change of a model's
    stored policy also starts a new shadow-sample epoch for it.
    """

    def __init__(
        self,
        settings: TrafficSettings,
        control: Control,
        manager: ModelManager,
        promoter: Promoter,
        metrics_registry: CollectorRegistry,
        *,
        require_staging: bool,
        database_url: str,
        replica: str,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.catalog = control.catalog
        self.metrics = TrafficMetrics(metrics_registry)
        self.stats = TrafficStats(settings.sample_window)
        self.in_flight = InFlight()
        self.faults = FaultInjector(self.metrics, rng)
        self.shadow = ShadowMirror(
            manager,
            self.stats,
            self.metrics,
            self.in_flight,
            queue_size=settings.shadow_queue_size,
            workers=settings.shadow_workers,
            when_idle=settings.shadow_when_idle,
            max_wait=settings.shadow_max_wait,
        )
        # Flushes, reads and leases share one small engine with short timeouts, apart from
        # the hub's main pool, so a busy pool never delays them and an outage fails fast.
        self._engine = membership_engine(database_url, settings.sql_timeout)
        self._sql = SqlWorker(settings.sql_timeout, name="traffic-sql")
        book = TrafficStatsBook(
            self._engine, retention=dt.timedelta(seconds=settings.stats_retention)
        )
        self.shared = SharedStats(
            self.stats,
            book,
            self.metrics,
            replica=replica,
            interval=settings.stats_flush_interval,
            sql=self._sql,
        )
        lease = AnalystLease(
            LeaseBook(self._engine),
            self._sql,
            self.metrics,
            holder=replica,
            ttl=settings.canary_lease,
        )
        self.canaries = CanaryController(
            control,
            promoter,
            self.shared,
            lease,
            self.metrics,
            require_staging=require_staging,
            tick_interval=settings.canary_tick,
            clock=clock,
        )
        self._rng = rng or random.Random()
        control.catalog.on_change(self._policies_changed)

    async def start(self) -> None:
        self.shadow.start()
        self.shared.start()
        self.canaries.start_loop()

    async def stop(self) -> None:
        await self.canaries.stop()
        await self.shadow.stop()
        await self.shared.stop()
        self._sql.shutdown()
        self._engine.dispose()

    @property
    def timer(self) -> Timer:
        """The clock request latencies are measured with (and injected delays wait on)."""
        return self.faults.timer

    def use_timer(self, timer: Timer) -> None:
        self.faults.timer = timer

    def policy(self, name: str) -> TrafficPolicyView | None:
        """The stored policy of `name` as this hub serves it (None: the default)."""
        return self.catalog.snapshot.traffic.get(name)

    # ---- hooks of serve() ---------------------------------------------------------------
    def begin(self, route: Route) -> ServedRequest:
        """A request starts: decide whether it is mirrored."""
        public = route.public_name
        policy = self.policy(public)
        shadow = policy.shadow if policy is not None else None
        if shadow is not None and (
            (shadow.model, shadow.version) == (route.name, route.version)
            or self._rng.random() * 100 >= shadow.percent
        ):
            shadow = None
        return ServedRequest(route, shadow=shadow)

    async def inject_faults(self, route: Route) -> None:
        await self.faults.apply(self.policy(route.public_name), route)

    def finish(self, request: ServedRequest, *, latency_s: float, status: int | None) -> None:
        """The request is over with HTTP `status` (None: cancelled, e.g. the client left,
        which says nothing about the model and is not recorded)."""
        request.finished = True
        route = request.route
        if status is None:
            return
        error = status >= 500
        policy = self.policy(route.public_name)
        self.stats.record(
            route.public_name,
            route.label,
            # The revision whose split routed it: readouts and canary steps are revisions.
            revision=policy.revision if policy is not None else 0,
            latency_s=latency_s,
            error=error,
            routed=route.split,
            tokens=request.tokens,
        )
        if not error and request.shadow is not None and request.replay is not None:
            self.shadow.offer(
                MirrorJob(
                    model=route.public_name,
                    shadow=request.shadow,
                    kind=route.kind,
                    replay=request.replay,
                    output=request.output,
                    primary_latency_s=latency_s,
                )
            )

    async def _policies_changed(self, old: RegistrySnapshot, new: RegistrySnapshot) -> None:
        for name in old.traffic.keys() | new.traffic.keys():
            if old.traffic.get(name) != new.traffic.get(name):
                self.stats.new_epoch(name)
