"""The canary controller: raise a version's share step by step, roll back on a breach,
promote it to production after the last step.

State lives in SQL (`registry.canaries`); this controller only decides. Every `tick(now)`
(the loop calls it each `traffic.canary_tick` seconds; tests call it with their own clock)
looks at each running canary whose analyst lease this replica holds (hub.traffic.analyst:
one replica at a time analyses a canary; another takes over, at the recorded step, when it
dies). Once the step's interval has elapsed and the canary has at least `min_requests` in
the step, `judge_step` (hub.traffic.canary_analysis) compares it with the baseline: its
error rate, significantly worse than the baseline's and above `max_error_rate`, or its
latency, significantly higher (Mann-Whitney U) with a median above `max_latency_ratio`
times the baseline's, is a breach.

A breach sets the split to 100% baseline and the state to `rolled_back` with the reason.
Otherwise the canary advances to the next step; after the last one it is promoted through
`Promoter.promote(..., to="production")` (validation gate and audit event included) and the
split is cleared. Each transition is a compare-and-set on the step, so even two analysts
(a lease that lapsed during a partition) never apply one twice.

Windows are traffic-policy revisions, summed over every replica (hub.traffic.shared): each
step writes the split once, so the step's window is the current revision; the baseline's
is the step's too, or, when it gets too little traffic in the step (at 100%), every
revision since the canary started. A restarted or new analyst sees what every replica
flushed; with no baseline traffic at all only the absolute error-rate threshold is checked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from hub.control import Control
from hub.errors import BadRequest, Conflict, HubError, NotFound
from hub.periodic import cancel_and_wait
from hub.promotion import Promoter
from hub.traffic.analyst import AnalystLease
from hub.traffic.canary_analysis import Analysis, judge_step
from hub.traffic.metrics import TrafficMetrics
from hub.traffic.shared import SharedStats
from registry.canaries import CanarySpec
from registry.errors import RegistryError
from registry.views import CanaryView, SplitView

log = logging.getLogger(__name__)


class CanaryController:
    """Decides and applies the steps of every running canary.

    Contract: `start`, `abort` and `status` are the commands (400/404/409 with the reason);
    `tick(now)` looks at each running canary once and returns what happened to it
    ("observing", "waiting", "advanced", "rolled_back", "promoted", "aborted", "raced",
    "failed", or "standby" when another replica holds its lease). The decision itself is
    `judge_step` (pure); this class reads the shared statistics, holds the lease and applies
    transitions through `Control`, each a compare-and-set that refreshes this hub's catalog
    when it happened.
    """

    def __init__(
        self,
        control: Control,
        promoter: Promoter,
        shared: SharedStats,
        lease: AnalystLease,
        metrics: TrafficMetrics,
        *,
        require_staging: bool,
        tick_interval: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.control = control
        self.catalog = control.catalog
        self.promoter = promoter
        self.shared = shared
        self.lease = lease
        self.metrics = metrics
        self.require_staging = require_staging
        self.tick_interval = tick_interval
        self.clock = clock
        # Completed ticks; tests and probes use it as a logical clock.
        self.ticks = 0
        # Canaries this process has seen running (to set the weight gauge once).
        self._seen: set[int] = set()
        self._analyses: dict[int, Analysis] = {}
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    # ---- commands -----------------------------------------------------------------------
    async def start(self, name: str, version: int, spec: CanarySpec, *, actor: str) -> CanaryView:
        """Start a canary of `version` against production; 400/404/409 with the reason."""
        model = await self.control.model(name)
        if version not in model.versions:
            known = ", ".join(str(v) for v in sorted(model.versions))
            raise BadRequest(
                f"model {name} has no version {version} (versions: {known})", param="version"
            )
        baseline = model.aliases.get("production")
        if baseline is None:
            raise Conflict(
                f"{name} has no production version to compare a canary with; promote one first"
            )
        if baseline == version:
            raise Conflict(f"{name} v{version} is already production; nothing to canary")
        if self.require_staging:
            passed = await self.control.passed_stage(name, version)
            if not passed:
                raise Conflict(
                    f"{name} v{version} has not passed staging, and the canary ends by promoting "
                    "it to production; promote it to staging first (or set "
                    "registry.require_staging: false)"
                )
        canary = await self.control.start_canary(
            name, version, baseline=baseline, spec=spec, actor=actor, now=self.clock()
        )
        self._seen.add(canary.id)
        self.metrics.canary_weight.labels(name, str(version)).set(canary.weight)
        log.info(
            "canary of %s v%d against v%d started by %s: steps %s every %.0fs",
            name,
            version,
            baseline,
            actor,
            list(spec.steps),
            spec.interval_s,
        )
        return canary

    async def abort(self, name: str, *, actor: str, reason: str = "") -> CanaryView:
        """Stop the running canary of `name`; all traffic back to the baseline."""
        canary = await self.control.latest_canary(name)
        if canary is None or canary.state != "running":
            raise Conflict(f"{name} has no running canary to abort")
        why = f"aborted by {actor}" + (f": {reason}" if reason else "")
        done = await self._finish(canary, "aborted", why, self._all_to_baseline(canary), None)
        if done is None:
            raise Conflict(f"the canary of {name} finished while it was being aborted; retry")
        return done

    async def status(self, name: str) -> CanaryView | None:
        return await self.control.latest_canary(name)

    def describe(self, canary: CanaryView | None) -> dict[str, Any] | None:
        """The canary as the API shows it, with this process's latest live analysis."""
        if canary is None:
            return None
        analysis = self._analyses.get(canary.id) if canary.state == "running" else None
        return {
            "id": canary.id,
            "model": canary.model,
            "version": canary.canary_version,
            "baseline_version": canary.baseline_version,
            "state": canary.state,
            "reason": canary.reason,
            "steps": list(canary.steps),
            "step_index": canary.step_index,
            "weight": canary.weight,
            "promoting": canary.state == "running" and canary.step_index >= len(canary.steps),
            "step_started_at": canary.step_started_at,
            "interval_s": canary.interval_s,
            "max_error_rate": canary.max_error_rate,
            "max_latency_ratio": canary.max_latency_ratio,
            "min_requests": canary.min_requests,
            "started_by": canary.actor,
            "created_at": canary.created_at.isoformat(),
            "finished_at": canary.finished_at.isoformat() if canary.finished_at else None,
            "last_check": canary.last_check,
            "observation": None
            if analysis is None
            else {
                "decision": analysis.decision,
                "reason": analysis.reason,
                **analysis.check,
            },
        }

    # ---- the loop -----------------------------------------------------------------------
    def start_loop(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="canary controller")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        await self.lease.release_all()  # a peer takes over at its next tick

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_interval)
            try:
                await self.tick()
            except Exception as e:  # keep watching; the next tick retries
                log.warning("canary controller tick failed: %s: %s", type(e).__name__, e)

    async def tick(self, now: float | None = None) -> dict[str, str]:
        """Look at every running canary once; returns {model: what happened}."""
        async with self._lock:
            now = self.clock() if now is None else now
            outcomes: dict[str, str] = {}
            for canary in await self.control.running_canaries():
                if not await self.lease.hold(canary.model):
                    outcomes[canary.model] = "standby"
                    continue
                try:
                    async with self.lease.keep(canary.model):
                        outcomes[canary.model] = await self._tick_one(canary, now)
                except Exception:
                    log.exception("canary of %s: tick failed", canary.model)
                    outcomes[canary.model] = "failed"
            self.ticks += 1
            return outcomes

    async def _tick_one(self, canary: CanaryView, now: float) -> str:
        if canary.id not in self._seen:  # first seen by this process (a restart, a takeover)
            self._seen.add(canary.id)
            self.metrics.canary_weight.labels(canary.model, str(canary.canary_version)).set(
                canary.weight
            )
        if canary.step_index >= len(canary.steps):
            return await self._promote(canary)  # a promotion interrupted (restart) resumes
        model = self.catalog.snapshot.models.get(canary.model)
        if model is None:  # registered after the catalog's last refresh
            return "observing"
        production = model.aliases.get("production")
        if production == canary.canary_version:
            done = await self._finish(
                canary,
                "promoted",
                "production points to the canary version (promoted outside the controller)",
                [],
                None,
            )
            return "promoted" if done else "raced"
        if production != canary.baseline_version:
            reason = (
                f"production moved from v{canary.baseline_version} to "
                f"v{production} during the canary"
            )
            done = await self._finish(
                canary, "aborted", reason, self._all_to_baseline(canary), None
            )
            return "aborted" if done else "raced"
        if now - canary.step_started_at < canary.interval_s:
            return "observing"
        analysis = await self.analyse(canary)
        self._analyses[canary.id] = analysis
        check = {
            "at": now,
            "decision": analysis.decision,
            "reason": analysis.reason,
            **analysis.check,
        }
        if analysis.decision == "wait":
            return "waiting"
        if analysis.decision == "breach":
            done = await self._finish(
                canary, "rolled_back", analysis.reason, self._all_to_baseline(canary), check
            )
            return "rolled_back" if done else "raced"
        advanced = await self.control.advance_canary(
            canary, now=now, check=check, actor=f"canary:{canary.actor}"
        )
        if advanced is None:
            return "raced"
        self.metrics.canary_decisions.labels(canary.model, "advance").inc()
        if advanced.step_index >= len(advanced.steps):
            return await self._promote(advanced)
        self.metrics.canary_weight.labels(canary.model, str(canary.canary_version)).set(
            advanced.weight
        )
        log.info(
            "canary of %s v%d: step %d passed, now %g%% (%s)",
            canary.model,
            canary.canary_version,
            canary.step_index + 1,
            advanced.weight,
            analysis.reason,
        )
        return "advanced"

    # ---- analysis -----------------------------------------------------------------------
    async def analyse(self, canary: CanaryView) -> Analysis:
        """Compare canary and baseline over the current step, every replica's traffic."""
        policy = self.catalog.snapshot.traffic.get(canary.model)
        totals = await self.shared.totals(
            canary.model,
            # Starting the canary wrote its first revision, each step one more.
            revisions=canary.step_index + 1,
            local_revision=policy.revision if policy is not None else 0,
        )
        if not totals.shared:  # a decision on this replica's share alone would be wrong
            return Analysis(
                "wait",
                "the database did not answer: the other replicas' traffic is unknown for now",
                {"step_index": canary.step_index, "weight": canary.weight},
            )
        ours = totals.arm(str(canary.canary_version))
        base = totals.arm(str(canary.baseline_version))
        scope = "step"
        if base.requests < canary.min_requests:
            base = totals.arm(str(canary.baseline_version), current_only=False)
            scope = "canary" if base.requests >= canary.min_requests else "none"
        return judge_step(canary, ours, base, baseline_window=scope, replicas=totals.replicas)

    # ---- transitions --------------------------------------------------------------------
    @staticmethod
    def _all_to_baseline(canary: CanaryView) -> list[SplitView]:
        return [SplitView(model=canary.model, version=canary.baseline_version, weight=100.0)]

    async def _finish(
        self,
        canary: CanaryView,
        state: str,
        reason: str,
        splits: list[SplitView],
        check: dict[str, Any] | None,
    ) -> CanaryView | None:
        done = await self.control.finish_canary(
            canary, state=state, reason=reason, splits=splits, check=check,
            actor=f"canary:{canary.actor}",
        )  # fmt: skip
        if done is None:
            return None
        self._seen.discard(canary.id)
        await self.lease.release(canary.model)
        self.metrics.canary_weight.labels(canary.model, str(canary.canary_version)).set(0)
        decision = {"promoted": "promote", "rolled_back": "rollback", "aborted": "abort"}[state]
        self.metrics.canary_decisions.labels(canary.model, decision).inc()
        (log.info if state == "promoted" else log.warning)(
            "canary of %s v%d %s: %s", canary.model, canary.canary_version, state, reason
        )
        return done

    async def _promote(self, canary: CanaryView) -> str:
        """The last step passed: production moves to the canary through the gate."""
        name, version = canary.model, canary.canary_version
        model = await self.control.model(name)
        if model.aliases.get("production") != version:
            try:
                await self.promoter.promote(
                    name,
                    version,
                    "production",
                    actor=f"canary:{canary.actor}",
                    reason=f"canary passed steps {', '.join(f'{w:g}%' for w in canary.steps)}",
                )
            except (HubError, RegistryError) as e:
                if isinstance(e, NotFound):
                    raise
                message = e.message if isinstance(e, HubError) else str(e)
                reason = f"passed every step, but the promotion to production failed: {message}"
                done = await self._finish(
                    canary, "rolled_back", reason, self._all_to_baseline(canary), None
                )
                return "rolled_back" if done else "raced"
        reason = (
            f"passed every step ({', '.join(f'{w:g}%' for w in canary.steps)}); "
            f"v{version} is production"
        )
        done = await self._finish(canary, "promoted", reason, [], None)
        return "promoted" if done else "raced"
