"""Moving models off their devices: for room, when their keep-alive runs out, or by an admin.

An eviction waits for the model's requests in flight to finish (those chosen for room are
already idle), then parks its weights in the host tier when they fit there (dropping the
tier's least recently used models if needed) or unloads it for good. The device's ledger
charge is released only once the memory is free, and the room pump runs right away so a
waiting load takes the room at once. The blocking steps go through the `Lifecycle` in worker
threads; the bookkeeping around each await is finished before it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from backends.workers import WorkerPool
from hub.manager.lifecycle import Lifecycle
from hub.manager.planning import ModelKey, Planner
from hub.manager.reports import StatusReports, labels
from hub.manager.residency import ModelState
from hub.manager.state import Entry
from hub.metrics import HubMetrics

if TYPE_CHECKING:
    from backends.base import Backend

log = logging.getLogger(__name__)


class Evictions:
    """Starts and runs evictions and drops; `pump` starts the evictions the planner picks."""

    def __init__(
        self,
        entries: Mapping[ModelKey, Entry],
        planner: Planner,
        lifecycle: Lifecycle,
        metrics: HubMetrics,
        reports: StatusReports,
    ) -> None:
        self._entries = entries
        self._planner = planner
        self._lifecycle = lifecycle
        self._metrics = metrics
        self._reports = reports
        # Parks and unloads run here (backends/workers.py), never behind loads or other work.
        self.threads = WorkerPool("model-evictions", 4)
        # Told the base's key whenever an adapter has left its base (its keep-alive may run).
        self.on_adapter_left: Callable[[ModelKey], None] | None = None

    def pump(self) -> None:
        """Let the planner grant what fits now and start the evictions it chose."""
        for key, _device in self._planner.pump():
            self.start(self._entries[key], "pressure")

    def start(self, entry: Entry, reason: str, *, keep_warm: bool = True) -> asyncio.Task[None]:
        """Move `entry` off its device once its requests finish: parked in the host tier when
        `keep_warm` and it fits there, dropped otherwise. The state changes at once, so
        nothing else picks it or serves from it meanwhile. A base's adapters leave first, the
        same way (parked with it, or dropped with it)."""
        if entry.evict_task is not None and not entry.evict_task.done():
            return entry.evict_task
        self._adapters_leave(entry.key, keep_warm)
        entry.move(ModelState.EVICTING)
        entry.expires_at = None
        if reason == "pressure":
            self._planner.policy.on_evict(entry.key)
        entry.evict_task = asyncio.create_task(
            self._evict(entry, reason, keep_warm), name=f"evict {entry.key}"
        )
        return entry.evict_task

    def _adapters_leave(self, base: ModelKey, keep_warm: bool) -> list[asyncio.Task[None]]:
        """Start moving the loaded adapters of `base` off it; returns the evictions under way
        of its adapters. An adapter still loading is not waited for here: it either holds
        the base (the base's eviction waits for it to drain) or waits for this eviction."""
        tasks = []
        for key in self._planner.adapters_on(base):
            adapter = self._entries[key]
            if adapter.state is ModelState.LOADED:
                tasks.append(self.start(adapter, "base", keep_warm=keep_warm))
            elif adapter.state is ModelState.EVICTING and adapter.evict_task is not None:
                tasks.append(adapter.evict_task)
        return tasks

    async def _evict(self, entry: Entry, reason: str, keep_warm: bool) -> None:
        # A base leaves after its adapters, including any attached while it drained.
        while True:
            await entry.idle.wait()
            tasks = self._adapters_leave(entry.key, keep_warm)
            if not tasks:
                break
            await asyncio.gather(*map(asyncio.shield, tasks), return_exceptions=True)
        device = entry.device
        parked = False
        try:
            if keep_warm and entry.backend is not None:
                parked = await self._park(entry, entry.backend, device)
            if not parked:
                await self.drop(entry, reason)
        finally:
            self._planner.ledger.release(entry.key)
            entry.device = None
            entry.move(ModelState.WARM if parked else ModelState.UNLOADED)
            self._metrics.evictions.labels(*labels(entry), reason).inc()
            log.info("%s left %s (%s)%s", entry.key, device, reason,
                     ", parked in the host tier" if parked else "")  # fmt: skip
            self._reports.update_gauges()
            if entry.base is not None and self.on_adapter_left is not None:
                self.on_adapter_left(entry.base)
            self.pump()

    async def _park(self, entry: Entry, backend: Backend, device: str | None) -> bool:
        """Offload into the host tier, dropping its least recently used models for room;
        False when the weights do not fit there."""
        tier = self._planner.host_tier
        nbytes = backend.offload_bytes()
        if not tier.admits(nbytes):
            return False
        # Victims leave and the room is taken before any await, so a concurrent eviction
        # cannot take the same room and a dropped model cannot start a restore meanwhile.
        victims = [v for k in tier.victims_for(nbytes)
                   for v in self._detach_all(self._entries[k], "host_tier")]  # fmt: skip
        fits = nbytes <= tier.free_bytes
        if fits:
            tier.add(entry.key, nbytes)
            tier.hold(entry.key)  # not droppable before its weights are there
        for victim, parked_backend, _ in victims:
            await self._dispose(victim, parked_backend, None)
        if not fits:
            return False
        try:
            await self.threads.run(self._lifecycle.park, backend, device or "cpu")
        except Exception as e:
            log.error("offloading %s failed, dropping it instead: %r", entry.key, e)
            tier.remove(entry.key)
            return False
        tier.unhold(entry.key)
        entry.host_bytes = nbytes
        return True

    async def drop(self, entry: Entry, reason: str) -> None:
        """Unload `entry` for good, whichever copy it has (device or parked). The caller
        releases any device charge; a parked copy's host-tier charge is released here."""
        for detached in self._detach_all(entry, reason):
            await self._dispose(*detached)

    def _detach_all(
        self, entry: Entry, reason: str
    ) -> list[tuple[Entry, Backend | None, str | None]]:
        """`_detach` of `entry` after its parked adapters': their host copies live in its
        engine, so they go with it."""
        parked = [e for e in self._entries.values()
                  if e.base == entry.key and e.state is ModelState.WARM]  # fmt: skip
        return [self._detach(e, "base") for e in parked] + [self._detach(entry, reason)]

    def _detach(self, entry: Entry, reason: str) -> tuple[Entry, Backend | None, str | None]:
        """Take `entry`'s backend away (and its host-tier charge) at once; returns it with the
        device its memory is on (None: host memory) for `_dispose`."""
        backend, entry.backend = entry.backend, None
        entry.attached_to = None
        parked = self._planner.host_tier.remove(entry.key) > 0
        entry.host_bytes = 0
        if entry.state is ModelState.WARM:
            entry.move(ModelState.UNLOADED)
            self._metrics.evictions.labels(*labels(entry), reason).inc()
        self._planner.policy.forget(entry.key)
        return entry, backend, None if parked else entry.device

    async def _dispose(self, entry: Entry, backend: Backend | None, device: str | None) -> None:
        """Stop the backend's workers, then unload it in a worker thread."""
        if backend is None:
            return
        # An adapter's device slot is the engine's to reuse: no drop in the allocator to check.
        measured = entry.measured_bytes if entry.base is None else 0
        try:
            await backend.aclose()
            await self.threads.run(self._lifecycle.unload, backend, device, measured)
        except Exception:
            log.exception("unloading %s failed; its memory may not be freed", entry.key)
        finally:
            del backend
            self._reports.update_gauges()
