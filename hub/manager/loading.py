"""Bringing a model onto a device: a cold load from the verified cache or a warm restore.

A cold load prepares the version (verified local copy), resolves its deployment, predicts
its footprint; a warm restore reuses what was measured before. Either way the load then asks
the planner for that many bytes and waits until they are charged to it on a device (the
waiters' own timeouts bound the wait), loads or restores in a worker thread while measuring,
and settles the ledger to the larger of prediction and measurement, waiting for more room if
the model came out larger than predicted. Outcomes: LOADED; back to WARM/UNLOADED with the
reason when no room could be made, or when the registry's database or MLflow did not answer
(no backoff: not the model's fault, and the next request after the dependency is back loads
it); FAILED with a backoff otherwise. One load per model: every waiter awaits the same task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from backends.load_cancel import LoadCancelled, cancellable
from backends.workers import WorkerPool
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
from registry.outage import as_unavailable

if TYPE_CHECKING:
    from backends.base import Backend
    from hub.manager.loader import PreparedVersion

log = logging.getLogger(__name__)

FAILURE_BACKOFF_S = (1.0, 5.0, 30.0, 120.0)

# A load's outcome: the backend, its measured bytes, its device, the seconds the load took.
Landed = tuple["Backend", int, str, float]
HoldBase = Callable[[ModelKey], contextlib.AbstractAsyncContextManager[Entry]]


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
        hold_base: HoldBase,
    ) -> None:
        self._settings = settings
        # Brings an adapter's base up and holds it (a reference, as a request holds one)
        # while the adapter is placed and attached.
        self._hold_base = hold_base
        self._planner = planner
        self._lifecycle = lifecycle
        self._evictions = evictions
        self._keep_alive = keep_alive
        self._metrics = metrics
        self._reports = reports
        self._specs = model_specs
        self._failures: dict[ModelKey, tuple[int, float]] = {}  # key -> (count, retry at)
        # Every blocking step of a load runs here (backends/workers.py): a load stuck on its
        # files or a slow download waits for other loads only, never evictions or requests.
        self.threads = WorkerPool("model-loads", 8)

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
        error = await self._load_once(entry)
        left = self._evictions.on_adapter_left
        if error is not None and entry.base is not None and left is not None:
            # An adapter that did not come up (failed, refused, timed out) no longer keeps
            # its base: the base's keep-alive, held off while it loaded, may run now.
            left(entry.base)
        return error

    async def _load_once(self, entry: Entry) -> Unavailable | None:
        tier = self._planner.host_tier
        warm = entry.backend is not None and entry.key in tier
        source = "warm" if warm else "cold"
        prepared: PreparedVersion | None = None
        deadline = time.monotonic() + self._settings.load_timeout
        try:
            prep_s = 0.0
            if warm:
                tier.hold(entry.key)
            else:
                start = time.perf_counter()
                prepared = await self.threads.run(self._lifecycle.prepare, entry.key)
                entry.kind = prepared.view.kind
                entry.base = prepared.base
                entry.deployment = Deployment.resolve(
                    prepared.config,
                    self._specs.get(entry.key.name),
                    self._planner.budgets,
                )
                prep_s = time.perf_counter() - start
            if entry.base is not None:
                # An adapter: its base is brought up (and held) first, then it is attached.
                async with self._hold_base(entry.base) as base:
                    backend, measured, device, work_s = await self._attach(entry, base, prepared)
            else:
                backend, measured, device, work_s = await self._place_and_load(
                    entry, prepared, deadline
                )
            # The reload cost the eviction policy weighs: preparing plus the load itself.
            load_s = prep_s + work_s
        except NoRoom as e:
            return self._refused(entry, e, warm)
        except LoadCancelled as e:
            return self._timed_out(entry, e)
        except Unavailable as e:  # the base could not be brought up: not the adapter's fault
            code = e.code or "base_unavailable"
            return self._refused(
                entry, NoRoom(f"base of {entry.key}: {e.message}", code=code), warm
            )
        except asyncio.CancelledError:
            self._planner.ledger.release(entry.key)
            tier.unhold(entry.key)
            entry.device = None
            raise
        except Exception as e:
            outage = as_unavailable(e, f"loading {entry.key}")
            if outage is not None:
                return self._dependency_down(entry, outage.dependency, str(outage), warm)
            return await self._failed(entry, e, source)
        entry.backend = backend
        entry.measured_bytes = measured
        if not warm:
            what = f"{entry.key} on {device}"
            check_prediction(what, entry.predicted_bytes, measured)
        try:
            await self._settle(entry, self._charge(entry))
        except NoRoom as e:
            # It loaded larger than predicted and no room could be made for the difference.
            await self._evictions.drop(entry, "overflow")
            e.message += "; it measured more than predicted: raise manager.load_overhead_bytes"
            return self._refused(entry, e, warm=False)
        self._loaded(entry, device, source, load_s)
        return None

    async def _place_and_load(
        self, entry: Entry, prepared: PreparedVersion | None, deadline: float
    ) -> Landed:
        """Room on a device, then a cold load of `prepared` (None: a warm restore), cancelled
        at `deadline` (monotonic)."""
        if prepared is None:
            # Restored as it was (KV cache included): the same bytes on any device.
            size = max(entry.predicted_bytes, entry.measured_bytes)
            need = dict.fromkeys(self._devices_for(entry), size)
        else:
            budgets = {d: self._planner.budgets[d] for d in self._devices_for(entry)}
            need = await self.threads.run(self._lifecycle.predict, prepared, budgets)
            entry.predicted_bytes = max(need.values())
        self._planner.check_feasible(entry.key, need)  # NoRoom when waiting cannot help
        prefer = entry.last_device if entry.key in self._planner.host_tier else None
        device = entry.device = await self.wait_for_room(entry, need, prefer)
        if prepared is None:
            return await self._restore(entry, device)
        entry.predicted_bytes = need[device]
        start = time.perf_counter()
        backend, measured = await self._load_until(entry, prepared, device, deadline)
        return backend, measured, device, time.perf_counter() - start

    async def _attach(self, entry: Entry, base: Entry, prepared: PreparedVersion | None) -> Landed:
        """Room for an adapter on its (held, loaded) base's device, then attach it to the
        base's backend (`prepared`) or make its parked copy servable again (None)."""
        assert base.device is not None and base.backend is not None  # held while LOADED
        if prepared is None and entry.attached_to is not base.backend:
            # Its base was dropped and loaded anew while this restore waited for it: the
            # parked copy went with the old engine, so it is attached afresh.
            self._planner.host_tier.remove(entry.key)
            entry.host_bytes = 0
            prepared = await self.threads.run(self._lifecycle.prepare, entry.key)
        if prepared is None:
            need = {base.device: self._charge(entry)}
        else:
            budgets = {base.device: self._planner.budgets[base.device]}
            need = await self.threads.run(self._lifecycle.predict, prepared, budgets)
            entry.predicted_bytes = need[base.device]
        self._planner.check_feasible(entry.key, need)
        device = entry.device = await self.wait_for_room(entry, need)
        if prepared is None:
            return await self._restore(entry, device)
        start = time.perf_counter()
        backend, measured = await self.threads.run(
            self._lifecycle.attach, prepared, base.backend, device
        )
        entry.attached_to = base.backend
        return backend, measured, device, time.perf_counter() - start

    async def _restore(self, entry: Entry, device: str) -> Landed:
        """Bring `entry`'s parked weights back onto `device` (room granted)."""
        assert entry.backend is not None
        start = time.perf_counter()
        measured = await self.threads.run(self._lifecycle.restore, entry.backend, device)
        seconds = time.perf_counter() - start
        self._planner.host_tier.remove(entry.key)
        entry.host_bytes = 0
        return entry.backend, measured, device, seconds

    async def _load_until(
        self, entry: Entry, prepared: PreparedVersion, device: str, deadline: float
    ) -> tuple[Any, int]:
        """The cold load in a worker thread, cancelled at `deadline` (monotonic): then the
        thread is waited for (it stops at its next check) and a backend it finished anyway is
        unloaded, so its memory is back before LoadCancelled is raised."""
        flag = threading.Event()
        budget = self._planner.budgets[device]

        def load() -> tuple[Any, int]:
            with cancellable(flag):
                return self._lifecycle.load(prepared, device, budget)

        work = asyncio.ensure_future(self.threads.run(load))
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                return await asyncio.shield(work)
        except TimeoutError:
            pass
        except asyncio.CancelledError:
            # Shutting down: stop allocating; nobody waits for the outcome (retrieved here so
            # that its LoadCancelled is not reported as never retrieved).
            flag.set()
            work.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise
        flag.set()
        log.warning("%s: cancelling its load, still running after load_timeout (%gs)",
                    entry.key, self._settings.load_timeout)  # fmt: skip
        try:
            backend, measured = await work
        except LoadCancelled as e:
            raise LoadCancelled(f"{entry.key}: {e}") from e
        # Finished before it saw the flag: too late for its waiters; give it back.
        await self.threads.run(self._lifecycle.unload, backend, device, measured)
        raise LoadCancelled(f"{entry.key}: loaded only after load_timeout; unloaded again")

    def _timed_out(self, entry: Entry, e: LoadCancelled) -> Unavailable:
        """Cancelled past its time: room released, retryable at once (no backoff)."""
        self._planner.ledger.release(entry.key)
        entry.device = None
        entry.move(ModelState.UNLOADED)
        entry.error = str(e)
        self._metrics.loads.labels(*labels(entry), "timeout", "cold").inc()
        self._reports.update_gauges()
        self._evictions.pump()  # the room it held may serve another load now
        return Unavailable(
            f"{e}; retry, or raise manager.load_timeout if this model needs longer to load",
            retry_after=self._settings.retry_after,
            code="load_timeout",
        )

    @staticmethod
    def _charge(entry: Entry) -> int:
        """What the ledger charges `entry` once loaded: the larger of prediction and
        measurement; for an adapter its measurement (the engine's own count of its bytes in
        the base's dtype, exact; the prediction reads the file's dtype, float32 as PEFT
        saves it, so twice a bf16 base's figure)."""
        if entry.base is not None and entry.measured_bytes:
            return entry.measured_bytes
        return max(entry.predicted_bytes, entry.measured_bytes)

    def _devices_for(self, entry: Entry) -> list[str]:
        """The devices `entry` may go to: the one its deployment names, else all."""
        assert entry.deployment is not None
        if entry.deployment.device:
            return self._planner.usable([entry.deployment.device])
        return self._planner.usable(list(self._planner.budgets))

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
        verb = "restored" if source == "warm" else "loaded"
        if entry.base is not None:
            self._metrics.adapter_loads.labels(str(entry.base), *labels(entry), source).inc()
            self._metrics.adapter_load_seconds.labels(source).observe(load_s)
            verb = f"{verb} (adapter on {entry.base})"
        log.info("%s %s onto %s in %.4fs (%d bytes)", entry.key, verb, device, load_s,
                 self._planner.ledger.charge_of(entry.key))  # fmt: skip
        self._reports.update_gauges()
        if entry.waiting == 0 and entry.in_flight == 0:
            self._keep_alive.arm(entry)

    def _refused(self, entry: Entry, e: NoRoom, warm: bool) -> Unavailable:
        """No room now: not the model's fault, so no backoff; a warm copy stays parked."""
        self._set_back(entry, e.message, "no_room", warm)
        return Unavailable(e.message, retry_after=self._settings.retry_after, code=e.code)

    def _dependency_down(
        self, entry: Entry, dependency: str, message: str, warm: bool
    ) -> Unavailable:
        """The registry's database or MLflow did not answer: not the model's fault, so no
        backoff; the first request after the dependency is back loads it."""
        self._set_back(entry, message, "dependency_down", warm)
        return Unavailable(
            message, retry_after=self._settings.retry_after, code=f"{dependency}_unavailable"
        )

    def _set_back(self, entry: Entry, message: str, outcome: str, warm: bool) -> None:
        """Back to where the load started (a warm copy stays parked), with the reason."""
        self._planner.ledger.release(entry.key)
        self._planner.host_tier.unhold(entry.key)
        entry.device = None
        parked = warm and entry.backend is not None
        entry.move(ModelState.WARM if parked else ModelState.UNLOADED)
        entry.error = message
        self._metrics.loads.labels(*labels(entry), outcome, "warm" if warm else "cold").inc()
        log.warning("%s", message)

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
