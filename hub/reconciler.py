"""Keeps the hub converged on the registry: follows alias moves without a restart, records
drift between MLflow and SQL, and keeps configured models' serving versions loaded.

Every `registry.poll_interval` seconds — or at once when MLflow's webhook (or the hub's own
promotion) kicks it — the reconciler repairs alias drift (recording MLflow's state in the
audit log), refreshes the catalog the router serves from, and, when a model's serving version
changed, preloads the new one if the model is configured with `preload` or `pin`; a `pin`
moves with the serving version (the new one is pinned, the old one unpinned). Requests in
flight keep the backend they acquired; the old version is left to the manager's keep-alive
and eviction like any idle model.

MLflow down: the catalog is read from SQL alone, so passes keep following what other
replicas write (traffic splits, canary steps, alias moves made through any hub) while the
drift check, the only part that reads MLflow, waits. The first pass after MLflow answers
again runs the full check (aliases and version lists): moves made in MLflow meanwhile are
recorded and followed, without a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from hub.control import Control
from hub.errors import NotFound
from hub.manager import ModelManager
from hub.metrics import HubMetrics
from hub.periodic import cancel_and_wait
from registry.drift import Drift
from registry.errors import DependencyUnavailable
from registry.views import RegistrySnapshot

log = logging.getLogger(__name__)


class Reconciler:
    """Converges this hub on the registry, one pass at a time.

    Contract: `reconcile()` runs one pass (passes never overlap): the catalog is refreshed
    from SQL, then alias drift between MLflow and SQL is recorded (MLflow wins, as an audit
    event) and exposed as `drift` and the `hub_registry_drift` gauge, and the catalog is
    refreshed again when that recorded a move. When a refresh changes a
    model's serving version, a model in `keep_loaded` gets its new version loaded (pinned, and
    the old one unpinned, when the model is in `pinned`). `start()` runs passes every
    `poll_interval` seconds or at once after `kick()`; a failing pass keeps the last good
    snapshot and records `last_error`. While `mlflow_up()` says MLflow is down (or a drift
    check finds it so), passes skip the drift check and still refresh the catalog;
    `drift_paused` says why, and the next check once it is back compares versions too.
    """

    def __init__(
        self,
        control: Control,
        manager: ModelManager,
        metrics: HubMetrics,
        *,
        poll_interval: float,
        version_check_every: int = 10,
        keep_loaded: frozenset[str] = frozenset(),
        pinned: frozenset[str] = frozenset(),
        mlflow_up: Callable[[], bool] = lambda: True,
    ) -> None:
        self.control = control
        self.mlflow_up = mlflow_up
        # Why the drift check is not running (MLflow unreachable); None while it runs.
        self.drift_paused: str | None = None
        self.manager = manager
        self.metrics = metrics
        self.poll_interval = poll_interval
        self.version_check_every = max(1, version_check_every)
        self.keep_loaded = keep_loaded | pinned
        self.pinned = pinned
        self.drift: list[Drift] = []
        self.last_error: str | None = None
        # Completed reconcile passes; tests and probes use it as a logical clock.
        self.rounds = 0
        self._lock = asyncio.Lock()
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._followups: set[asyncio.Task[None]] = set()
        control.catalog.on_change(self._serving_changed)

    def kick(self) -> None:
        """Reconcile now instead of at the next poll (webhooks, the hub's own changes)."""
        self._kick.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="reconciler")

    async def stop(self) -> None:
        """Cancel the loop and the preloads and wait until they have ended. An error one of
        them ended with is logged, not raised: a raise here would end the hub's shutdown
        before its later steps (the manager, the usage and rate-limit writes)."""
        tasks = [t for t in (self._task, *self._followups) if t is not None]
        try:
            await cancel_and_wait(*tasks)
        except Exception:  # the loop and the preloads log their own failures: this is a bug
            log.exception("a reconciler task had ended with an error before the stop")
        self._task = None

    async def reconcile(self, *, check_versions: bool = False) -> None:
        """One pass: repair alias drift, refresh what is served. Passes never overlap."""
        async with self._lock:
            await self._reconcile(check_versions)
            self.rounds += 1

    async def _reconcile(self, check_versions: bool) -> None:
        # SQL first: what other replicas wrote (splits, pins, alias moves through a hub) is
        # followed however slow MLflow is; again after the drift check recorded MLflow's own
        # moves, so those are served in the same pass.
        await self.control.refresh()
        if await self._check_drift(check_versions):
            await self.control.refresh()

    async def _check_drift(self, check_versions: bool) -> bool:
        """Compare MLflow with SQL; True when alias drift was recorded (what is served
        changed)."""
        if not self.mlflow_up():
            self.drift_paused = "MLflow is unreachable (background check)"
            return False
        # Back from an outage: compare the version lists too.
        check_versions = check_versions or self.drift_paused is not None
        try:
            drift = await self.control.find_drift(versions=check_versions)
        except DependencyUnavailable as e:
            if e.dependency != "mlflow":
                raise
            self.drift_paused = str(e)
            log.warning("drift check paused: %s", e)
            return False
        if self.drift_paused is not None:
            log.info("MLflow answers again: drift check resumed")
        self.drift_paused = None
        for item in drift:
            log.warning("registry drift (%s, %s): %s%s", item.model, item.kind, item.detail,
                        " - recorded in the audit log" if item.repaired else "")  # fmt: skip
        if check_versions or any(d.kind == "alias" for d in drift):
            self.drift = drift if check_versions else [
                *[d for d in self.drift if d.kind == "version"], *drift
            ]  # fmt: skip
        for kind in ("alias", "version"):
            self.metrics.registry_drift.labels(kind).set(
                sum(1 for d in self.drift if d.kind == kind and not d.repaired)
            )
        return any(d.kind == "alias" and d.repaired for d in drift)

    async def _loop(self) -> None:
        loops = 0
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation
            # that arrives as the wait ends, and this loop then outlived the shutdown that
            # cancelled it (a test's event loop hung tearing down).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_interval):
                    await self._kick.wait()
            self._kick.clear()
            try:
                await self.reconcile(check_versions=loops % self.version_check_every == 0)
                self.last_error = None
            except Exception as e:  # keep serving the last good snapshot
                self.last_error = f"{type(e).__name__}: {e}"
                log.warning("reconciling with the registry failed: %s", self.last_error)
            loops += 1

    async def _serving_changed(self, old: RegistrySnapshot, new: RegistrySnapshot) -> None:
        for name, model in new.models.items():
            before = old.models.get(name)
            now = model.default_version()
            was = before.default_version() if before is not None else None
            if before is None or now == was or now is None:
                continue
            log.info("%s is now served by v%s (was v%s)", name, now, was)
            if name in self.keep_loaded:
                task = asyncio.create_task(
                    self._preload(name, now, was), name=f"preload {name}@{now}"
                )
                self._followups.add(task)
                task.add_done_callback(self._followups.discard)

    async def _preload(self, name: str, version: int, was: int | None) -> None:
        try:
            if name not in self.pinned:
                await self.manager.load(name, version)
                return
            await self.manager.pin(name, version)
            if was is not None:
                # The version no longer served becomes evictable like any idle model.
                with contextlib.suppress(NotFound):
                    await self.manager.unpin(name, was)
        except Exception as e:
            log.error("preloading %s v%d after its alias moved failed: %s", name, version, e)
