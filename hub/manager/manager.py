"""Loads model versions on demand under per-device memory budgets and hands requests their
backend.

`async with manager.acquire(name, version) as backend:` is the only path from a request to a
backend. A miss starts one load that every request for the model awaits (a per-model limit on
waiters answers 503 beyond it). The load predicts the footprint, asks for that many bytes on
the device placement picks, evicting idle, unpinned models past their minimum residency when
needed (never one with requests in flight), then loads from the verified local cache, or
restores from the host tier when the model's weights are parked there. Each request holds a
reference until it finishes; keep-alive, admin unloads and evictions all wait for the
references to drop to zero. A load that fails marks the model `failed` with the reason and
is retried only after a backoff; other models are unaffected.

Everything here runs on the event loop; blocking work (prepare, load, park, restore, unload)
runs through the `Lifecycle` in worker threads, and no bookkeeping is left half done across
an await. `ModelManager` is a facade over composed parts, no base classes:

- `state.Entry` per model, whose state moves only as `residency` allows; a LoRA adapter's
  entry names its base's (`Entry.base`): its requests hold the base too, its load brings the
  base up first, and the base leaves only after its adapters (`planning.dependents`);
- `planning.Planner` (pure): ledger, host tier, placement, eviction policy, room, "why not";
- `lifecycle.Lifecycle`: the blocking work; `BackendLifecycle` for real backends;
- `loading.Loads` (cold loads, warm restores), `evicting.Evictions` (evictions, drops,
  the room pump), `expiry.KeepAliveClock` (keep-alive and the timer);
- `reports.StatusReports`: status rows and gauges.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING

from hub.errors import Conflict, NotFound, Unavailable
from hub.manager.devices import Device
from hub.manager.evicting import Evictions
from hub.manager.expiry import KeepAliveClock
from hub.manager.lifecycle import BackendLifecycle, Lifecycle
from hub.manager.loading import Loads
from hub.manager.planning import HostTier, MemoryLedger, ModelKey, NoRoom, Planner
from hub.manager.reports import StatusReports
from hub.manager.residency import ModelState
from hub.manager.state import DeviceStatus, Entry, HostTierStatus, ModelStatus
from hub.metrics import HubMetrics
from hub.settings import ManagerSettings, ModelSpec

if TYPE_CHECKING:
    from backends.base import Backend
    from hub.manager.loader import VersionLoader

log = logging.getLogger(__name__)


class ModelManager:
    """The model manager: `acquire` for requests; `load`, `unload`, `pin`, `unpin` for
    admins; `status`, `device_status`, `host_tier_status` for reports; `start`/`close`.
    Needs the running event loop; one instance per hub."""

    def __init__(
        self,
        settings: ManagerSettings,
        devices: Sequence[Device],
        loader: VersionLoader | None,
        metrics: HubMetrics,
        *,
        host_cache_budget: int = 0,
        model_specs: Mapping[str, ModelSpec] | None = None,
        lifecycle: Lifecycle | None = None,
    ) -> None:
        """`lifecycle` does the blocking work; by default real backends from `loader`."""
        self.settings = settings
        self.devices = list(devices)
        self.metrics = metrics
        if lifecycle is None:
            if loader is None:
                raise ValueError("ModelManager needs a loader or a lifecycle")
            from hub.manager.footprint import Footprint  # torch: only with real backends

            lifecycle = BackendLifecycle(
                loader, Footprint(self.devices, settings.load_overhead_bytes)
            )
        self.lifecycle = lifecycle
        self._entries: dict[ModelKey, Entry] = {}
        self.planner = Planner(
            {d.name: d.model_budget_bytes for d in self.devices},
            self._entries,
            host_budget=host_cache_budget,
            policy=settings.eviction_policy,
            min_residency=settings.min_residency,
        )
        self._reports = StatusReports(
            self.devices, self._entries, self.planner, metrics, settings.keep_alive
        )
        self._evictions = Evictions(self._entries, self.planner, lifecycle, metrics, self._reports)
        self._keep_alive = KeepAliveClock(
            self._entries,
            self.planner,
            self._evictions,
            default_keep_alive=settings.keep_alive,
            interval=settings.idle_check_interval,
        )
        self._loads = Loads(settings, self.planner, lifecycle, self._evictions,
                            self._keep_alive, metrics, self._reports,
                            dict(model_specs or {}), self._holding)  # fmt: skip
        self._evictions.on_adapter_left = self._base_freed

    @property
    def ledger(self) -> MemoryLedger:
        return self.planner.ledger

    @property
    def host_tier(self) -> HostTier:
        return self.planner.host_tier

    def start(self) -> None:
        """Start the keep-alive timer; needs the running event loop (also started lazily)."""
        self._keep_alive.reaper.start()

    # ---- request path ---------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def acquire(
        self, name: str, version: int, kind: str = "", *, keep_alive: float | None = None
    ) -> AsyncIterator[Backend]:
        """Hold the loaded backend of `name`@`version` for one request. `keep_alive` (seconds;
        -1 forever, 0 unload after this request, None the model's default) sets how long the
        model then stays resident, with Ollama's meaning. Raises Unavailable (503 with
        Retry-After) when the model cannot be brought up, naming what holds the memory."""
        entry = self._entry(ModelKey(name, version), kind)
        while True:
            await self._ensure_loaded(entry)
            # A LoRA adapter's request runs on its base's engine, so it holds the base too.
            base = self._entries[entry.base] if entry.base is not None else None
            if base is None or base.state is ModelState.LOADED:
                break
            # Attached while an admin unloaded its base: it leaves with it, then comes back.
            await asyncio.shield(self._evictions.start(entry, "base"))
        backend = entry.backend
        assert backend is not None  # LOADED has one, and nothing was awaited since the check
        self._hold(entry, keep_alive)
        if base is not None:
            self._hold(base, base.keep_alive)
            self.metrics.adapter_requests.labels(str(base.key), name, str(version)).inc()
        try:
            yield backend
        finally:
            self._release(entry)
            if base is not None:
                self._release(base)

    @contextlib.asynccontextmanager
    async def _holding(self, key: ModelKey) -> AsyncIterator[Entry]:
        """Bring `key` up and hold it like a request would (an adapter's load holds its base
        while the adapter is placed and attached)."""
        entry = self._entry(key, "llm")
        await self._ensure_loaded(entry)
        self._hold(entry, entry.keep_alive)
        try:
            yield entry
        finally:
            self._release(entry)

    def _hold(self, entry: Entry, keep_alive: float | None) -> None:
        assert entry.state is ModelState.LOADED
        entry.in_flight += 1
        entry.hits += 1
        entry.keep_alive = keep_alive
        entry.expires_at = None
        entry.idle.clear()
        self.planner.record_use(entry.key)

    def _base_freed(self, base: ModelKey) -> None:
        """An adapter left base `base`: its keep-alive may run now."""
        entry = self._entries.get(base)
        if entry is not None and entry.state is ModelState.LOADED and entry.in_flight == 0:
            self._keep_alive.arm(entry)

    def _release(self, entry: Entry) -> None:
        entry.in_flight -= 1
        entry.last_used = time.monotonic()
        if entry.in_flight == 0:
            entry.idle.set()
            if entry.state is ModelState.LOADED:
                self._keep_alive.arm(entry)
            self._evictions.pump()

    async def _ensure_loaded(self, entry: Entry) -> None:
        """Return once `entry` is LOADED, loading it (or joining its load) as needed, within
        the load timeout. No await separates the final check from the caller's next line, so
        a caller that takes a reference right after cannot lose the model in between."""
        self.start()
        try:
            async with asyncio.timeout(self.settings.load_timeout):
                while True:
                    if entry.state is ModelState.LOADED and entry.backend is not None:
                        return
                    if entry.state is ModelState.EVICTING and entry.evict_task is not None:
                        # Arriving during an eviction: wait for it, then bring the model back.
                        await asyncio.shield(entry.evict_task)
                        continue
                    error = await self._wait_for_load(entry)
                    if error is not None and error.code != "abandoned":
                        # A fresh exception per waiter: one raised object must not be shared.
                        raise Unavailable(
                            error.message, retry_after=error.retry_after, code=error.code
                        )
                    # Loaded, or a load every earlier waiter gave up on: look again.
        except TimeoutError:
            draining = (
                f" (it is being unloaded once its {entry.in_flight} requests in flight finish)"
                if entry.state is ModelState.EVICTING
                else ""
            )
            raise Unavailable(
                f"{entry.key} did not finish loading within {self.settings.load_timeout:g}s"
                + draining
                + self.planner.explain(entry.room),
                retry_after=self.settings.retry_after,
                code="load_timeout",
            ) from None

    async def _wait_for_load(self, entry: Entry) -> Unavailable | None:
        """Join (or start) the model's one load and return its outcome."""
        if entry.waiting >= self.settings.max_waiting_per_model:
            raise Unavailable(
                f"{entry.key}: {entry.waiting} requests already wait for this model to load "
                f"(limit {self.settings.max_waiting_per_model})",
                retry_after=self.settings.retry_after,
                code="too_many_waiting",
            )
        entry.waiting += 1
        start = time.perf_counter()
        try:
            return await asyncio.shield(self._loads.start(entry))
        finally:
            entry.waiting -= 1
            self.metrics.load_wait_seconds.observe(time.perf_counter() - start)
            if entry.waiting == 0 and entry.room is not None:
                # Every waiter timed out: stop making room for a load nobody wants now.
                self.planner.broker.abandon(
                    entry.room,
                    NoRoom(
                        f"gave up making room for {entry.key}: every request waiting for it "
                        "timed out" + self.planner.explain(entry.room),
                        code="abandoned",
                    ),
                )

    # ---- admin ----------------------------------------------------------------------------
    async def load(self, name: str, version: int) -> ModelStatus:
        """Bring a model onto a device without serving a request; its keep-alive (the
        model's default) then runs from now."""
        entry = self._entry(ModelKey(name, version), "")
        await self._ensure_loaded(entry)
        if entry.in_flight == 0:
            entry.keep_alive = None
            self._keep_alive.arm(entry)
        return self._reports.model(entry)

    async def unload(self, name: str, version: int, *, reason: str = "admin") -> ModelStatus:
        """Unload for good once the requests in flight have finished: device and host copies
        both, and any pin is lifted. New requests load it again."""
        key = ModelKey(name, version)
        entry = self._entries.get(key)
        if entry is None or (entry.backend is None and entry.state is not ModelState.LOADING):
            state = entry.state.value if entry is not None else "never loaded"
            raise NotFound(f"{key} is not loaded (state: {state})")
        while entry.state in (ModelState.LOADING, ModelState.EVICTING):
            task = entry.load_task if entry.state is ModelState.LOADING else entry.evict_task
            if task is None:
                break
            await asyncio.shield(task)
        entry.pinned = False
        if entry.state is ModelState.LOADED:
            await asyncio.shield(self._evictions.start(entry, reason, keep_warm=False))
        elif entry.state is ModelState.WARM:
            await self._evictions.drop(entry, reason)
        self._evictions.pump()
        return self._reports.model(entry)

    def release_copy(self, name: str, version: int, *, reason: str) -> bool:
        """Start moving an idle, unpinned, loaded model off its device now (parked warm when
        the host tier has room); False, doing nothing, in any other state. Placement gives
        back this way a copy that another replica serves (hub.placement)."""
        entry = self._entries.get(ModelKey(name, version))
        if entry is None or entry.state is not ModelState.LOADED:
            return False
        if entry.pinned or entry.in_flight or entry.waiting:
            return False
        self._evictions.start(entry, reason)
        return True

    async def pin(self, name: str, version: int) -> ModelStatus:
        """Load if needed and pin: never evicted until unpinned or unloaded. A model that
        cannot fit beside the models already pinned is refused (409) with the reason."""
        entry = self._entry(ModelKey(name, version), "")
        try:
            await self._ensure_loaded(entry)
        except Unavailable as e:
            if e.code in ("pinned_full", "too_large"):
                raise Conflict(f"cannot pin {entry.key}: {e.message}", code=e.code) from None
            raise
        entry.pinned = True
        entry.expires_at = None
        return self._reports.model(entry)

    async def unpin(self, name: str, version: int) -> ModelStatus:
        """Make a pinned model evictable again; its keep-alive starts if it is idle."""
        key = ModelKey(name, version)
        entry = self._entries.get(key)
        if entry is None or not entry.pinned:
            raise NotFound(f"{key} is not pinned")
        entry.pinned = False
        if entry.state is ModelState.LOADED and entry.in_flight == 0:
            self._keep_alive.arm(entry)
        self._evictions.pump()
        return self._reports.model(entry)

    async def close(self) -> None:
        """Stop the timer, cancel loads in progress and unload everything."""
        await self._keep_alive.reaper.stop()
        self.planner.broker.cancel_all()
        tasks = [t for e in self._entries.values() for t in (e.load_task, e.evict_task) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Adapters first: their unload talks to their base's engine.
        for entry in sorted(self._entries.values(), key=lambda e: e.base is None):
            if entry.backend is not None:
                await self._evictions.drop(entry, "shutdown")
            self.planner.ledger.release(entry.key)
            if entry.state is not ModelState.UNLOADED:
                entry.move(ModelState.UNLOADED)
            entry.device = None
        self._loads.threads.close()
        self._evictions.threads.close()

    def device_lost(self, device: str, reason: str) -> None:
        """`device` stopped computing (a probe failed: hub.dependencies.devices): nothing is
        placed on it again, and each model loaded there moves to `failed` with the reason,
        its ledger charge released; its backend is closed on a daemon thread, since a call
        into a dead CUDA context may never return. A later request loads it elsewhere, or
        is refused (503) naming the device. Loads and evictions under way there finish or
        time out on their own."""
        if device in self.planner.lost:
            return
        self.planner.lose_device(device, reason)
        message = f"device {device} is lost ({reason})"
        for entry in self._entries.values():
            if entry.device != device or entry.state is not ModelState.LOADED:
                continue
            backend, entry.backend = entry.backend, None
            self.planner.ledger.release(entry.key)
            entry.last_device = device
            entry.device = None
            entry.expires_at = None
            entry.move(ModelState.FAILED)
            entry.error = message
            if backend is not None:
                _close_in_background(backend, f"{entry.key} on lost {device}")
        self._evictions.pump()
        self._reports.update_gauges()

    # ---- reports --------------------------------------------------------------------------
    def entry(self, key: ModelKey) -> Entry | None:
        """The bookkeeping of `key`, if the manager has touched it (read it, do not change)."""
        return self._entries.get(key)

    def status(self) -> list[ModelStatus]:
        """One row per model version the manager has touched (`/admin/models`)."""
        return self._reports.models()

    def device_status(self) -> list[DeviceStatus]:
        """One row per device: budget, used, free, pinned bytes (`/admin/devices`)."""
        return self._reports.devices()

    def host_tier_status(self) -> HostTierStatus:
        return self._reports.host_tier()

    def _entry(self, key: ModelKey, kind: str) -> Entry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = Entry(key=key, kind=kind)
            entry.idle.set()
        return entry


def _close_in_background(backend: Backend, what: str) -> None:
    """Unload `backend` on a daemon thread nobody waits for (its worker threads stop; its
    device memory went with the context)."""

    def close() -> None:
        try:
            backend.unload()
        except Exception as e:
            log.warning("closing %s: %s", what, e)

    threading.Thread(target=close, name=f"close {what}", daemon=True).start()
