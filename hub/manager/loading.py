"""Bringing a model onto a device: a cold load from the verified cache or a warm restore.

A cold load prepares the version (verified local copy), resolves its deployment, predicts
its footprint; a warm restore reuses what was measured before. Either way the load then asks
the planner for that many bytes and waits until they are charged to it on a device (the
waiters' own timeouts bound the wait), loads or restores in a worker thread while measuring,
and settles the ledger to the larger of prediction and measurement, waiting for more room if
the model came out larger than predicted. Outcomes: LOADED; back to WARM/UNLOADED with the
reason when no room could be made (no backoff: not the model's fault); FAILED with a backoff
otherwise. One load per model: every waiter awaits the same task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from hub.errors import Unavailable
from hub.manager.deployment import Deployment
from hub.manager.evicting import Evictions
from hub.manager.expiry import KeepAliveClock
from hub.manager.lifecycle import Lifecycle, check_prediction
from hub.manager.planning import ModelKey, NoRoom, Planner
from hub.manager.reports import StatusReports, labels
from hub.manager.residency import ModelState
from hub.manager.state import Entry
from hub.metrics import HubMetrics
from hub.settings import ManagerSettings, ModelSpec

if TYPE_CHECKING:
    from hub.manager.loader import PreparedVersion

log = logging.getLogger(__name__)

FAILURE_BACKOFF_S = (1.0, 5.0, 30.0, 120.0)


class Loads:
    """Starts the one load of a model and runs it to an outcome its waiters share."""

    def __init__(
        self,
        settings: ManagerSettings,
        planner: Planner,
        lifecycle: Lifecycle,
        evictions: Evictions,
        keep_alive: KeepAliveClock,
        metrics: HubMetrics,
        reports: StatusReports,
        model_specs: Mapping[str, ModelSpec],
    ) -> None:
        self._settings = settings
        self._planner = planner
        self._lifecycle = lifecycle
        self._evictions = evictions
        self._keep_alive = keep_alive
        self._metrics = metrics
        self._reports = reports
        self._specs = model_specs
        self._failures: dict[ModelKey, tuple[int, float]] = {}  # key -> (count, retry at)

    def start(self, entry: Entry) -> asyncio.Task[Unavailable | None]:
        """The model's load in progress, or a new one; raises Unavailable while a failed
        model's backoff runs."""
        if entry.load_task is not None and not entry.load_task.done():
            return entry.load_task
        count, retry_at = self._failures.get(entry.key, (0, 0.0))
        if count and time.monotonic() < retry_at:
            raise Unavailable(
                f"{entry.key} failed to load ({entry.error}); next attempt in "
                f"{retry_at - time.monotonic():.0f}s",
                retry_after=retry_at - time.monotonic(),
                code="load_failed",
            )
        entry.move(ModelState.LOADING)
        entry.error = None
        entry.load_task = asyncio.create_task(self._load(entry), name=f"load {entry.key}")
        return entry.load_task

    async def wait_for_room(
        self, entry: Entry, need: dict[str, int], prefer: str | None = None
    ) -> str:
        """Wait until `need[device]` bytes are charged to `entry` on some device; returns
        the device. Withdrawn if cancelled; abandoned (NoRoom) when its last waiter gives up."""
        req = self._planner.request_room(entry.key, need, prefer)
        entry.room = req
        try:
            self._evictions.pump()
            # Victims still inside their minimum residency: the timer must wake when the
            # first passes it, not at its next idle check (up to idle_check_interval later).
            self._keep_alive.reaper.poke()
            return await req.granted
        except asyncio.CancelledError:
            self._planner.broker.withdraw(req)
            raise
        finally:
            entry.room = None

    async def _load(self, entry: Entry) -> Unavailable | None:
        """Bring `entry` onto a device; returns the error its waiters should raise, if any."""
        tier = self._planner.host_tier
        warm = entry.backend is not None and entry.key in tier
        source = "warm" if warm else "cold"
        prepared: PreparedVersion | None = None
        try:
            if warm:
                tier.hold(entry.key)
                # Restored as it was (KV cache included): the same bytes on any device.
                size = max(entry.predicted_bytes, entry.measured_bytes)
                need = dict.fromkeys(self._devices_for(entry), size)
                prep_s = 0.0
            else:
                start = time.perf_counter()
                prepared = await asyncio.to_thread(self._lifecycle.prepare, entry.key)
                entry.kind = prepared.view.kind
                entry.deployment = Deployment.resolve(
                    prepared.config,
                    self._specs.get(entry.key.name),
                    self._planner.budgets,
                )
                budgets = {d: self._planner.budgets[d] for d in self._devices_for(entry)}
                need = await asyncio.to_thread(self._lifecycle.predict, prepared, budgets)
                entry.predicted_bytes = max(need.values())
                prep_s = time.perf_counter() - start
            self._planner.check_feasible(entry.key, need)  # NoRoom when waiting cannot help
            prefer = entry.last_device if entry.key in tier else None
            device = entry.device = await self.wait_for_room(entry, need, prefer)
            if not warm:
                entry.predicted_bytes = need[device]
            start = time.perf_counter()
            if prepared is not None:
                backend, measured = await asyncio.to_thread(
                    self._lifecycle.load, prepared, device, self._planner.budgets[device]
                )
            else:
                assert entry.backend is not None
                backend = entry.backend
                measured = await asyncio.to_thread(self._lifecycle.restore, backend, device)
                tier.remove(entry.key)
                entry.host_bytes = 0
            load_s = time.perf_counter() - start + prep_s
        except NoRoom as e:
            return self._refused(entry, e, warm)
        except asyncio.CancelledError:
            self._planner.ledger.release(entry.key)
            tier.unhold(entry.key)
            entry.device = None
            raise
        except Exception as e:
            return await self._failed(entry, e, source)
        entry.backend = backend
        entry.measured_bytes = measured
        if not warm:
            what = f"{entry.key} on {device}"
            check_prediction(what, entry.predicted_bytes, measured)
        try:
            await self._settle(entry, max(entry.predicted_bytes, measured))
        except NoRoom as e:
            # It loaded larger than predicted and no room could be made for the difference.
            await self._evictions.drop(entry, "overflow")
            e.message += "; it measured more than predicted: raise manager.load_overhead_bytes"
            return self._refused(entry, e, warm=False)
        self._loaded(entry, device, source, load_s)
        return None

    def _devices_for(self, entry: Entry) -> list[str]:
        """The devices `entry` may go to: the one its deployment names, else all."""
        assert entry.deployment is not None
        if entry.deployment.device:
            return [entry.deployment.device]
        return list(self._planner.budgets)

    async def _settle(self, entry: Entry, charge: int) -> None:
        """Make `entry`'s ledger charge exactly `charge`, waiting for room if it grew (it
        loaded larger than predicted)."""
        ledger = self._planner.ledger
        extra = charge - ledger.charge_of(entry.key)
        if extra <= 0:
            ledger.shrink(entry.key, charge)
            return
        device = ledger.device_of(entry.key)
        assert device is not None
        await self.wait_for_room(entry, {device: extra})

    def _loaded(self, entry: Entry, device: str, source: str, load_s: float) -> None:
        entry.device = entry.last_device = device
        entry.move(ModelState.LOADED)
        entry.loaded_at = time.monotonic()
        entry.hits = 0
        entry.error = None
        if source == "warm":
            entry.warm_load_s = load_s
        else:
            entry.cold_load_s = load_s
        assert entry.deployment is not None
        entry.pinned = entry.pinned or entry.deployment.pin
        self._failures.pop(entry.key, None)
        self._planner.record_use(entry.key)
        self._metrics.loads.labels(*labels(entry), "ok", source).inc()
        self._metrics.load_seconds.labels(source).observe(load_s)
        log.info("%s %s onto %s in %.2fs (%d bytes)", entry.key,
                 "restored" if source == "warm" else "loaded", device, load_s,
                 self._planner.ledger.charge_of(entry.key))  # fmt: skip
        self._reports.update_gauges()
        if entry.waiting == 0 and entry.in_flight == 0:
            self._keep_alive.arm(entry)

    def _refused(self, entry: Entry, e: NoRoom, warm: bool) -> Unavailable:
        """No room now: not the model's fault, so no backoff; a warm copy stays parked."""
        self._planner.ledger.release(entry.key)
        self._planner.host_tier.unhold(entry.key)
        entry.device = None
        parked = warm and entry.backend is not None
        entry.move(ModelState.WARM if parked else ModelState.UNLOADED)
        entry.error = e.message
        outcome = ("no_room", "warm" if warm else "cold")
        self._metrics.loads.labels(*labels(entry), *outcome).inc()
        log.warning("%s", e.message)
        return Unavailable(e.message, retry_after=self._settings.retry_after, code=e.code)

    async def _failed(self, entry: Entry, e: Exception, source: str) -> Unavailable:
        self._planner.ledger.release(entry.key)
        count = self._failures.get(entry.key, (0, 0.0))[0] + 1
        delay = FAILURE_BACKOFF_S[min(count, len(FAILURE_BACKOFF_S)) - 1]
        self._failures[entry.key] = (count, time.monotonic() + delay)
        # A failed restore leaves the parked copy in an unknown state: drop it, reload cold.
        await self._evictions.drop(entry, "failed")
        entry.device = None
        entry.move(ModelState.FAILED)
        entry.error = f"{type(e).__name__}: {e}"
        self._metrics.loads.labels(*labels(entry), "failed", source).inc()
        log.error("loading %s failed (attempt %d, retry in %.0fs): %s",
                  entry.key, count, delay, entry.error)  # fmt: skip
        return Unavailable(
            f"{entry.key} failed to load: {entry.error}", retry_after=delay, code="load_failed"
        )
