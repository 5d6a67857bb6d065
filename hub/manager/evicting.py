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
from collections.abc import Mapping
from typing import TYPE_CHECKING

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

    def pump(self) -> None:
        """Let the planner grant what fits now and start the evictions it chose."""
        for key, _device in self._planner.pump():
            self.start(self._entries[key], "pressure")

    def start(self, entry: Entry, reason: str, *, keep_warm: bool = True) -> asyncio.Task[None]:
        """Move `entry` off its device once its requests finish: parked in the host tier when
        `keep_warm` and it fits there, dropped otherwise. The state changes at once, so
        nothing else picks it or serves from it meanwhile."""
        if entry.evict_task is not None and not entry.evict_task.done():
            return entry.evict_task
        entry.move(ModelState.EVICTING)
        entry.expires_at = None
        if reason == "pressure":
            self._planner.policy.on_evict(entry.key)
        entry.evict_task = asyncio.create_task(
            self._evict(entry, reason, keep_warm), name=f"evict {entry.key}"
        )
        return entry.evict_task

    async def _evict(self, entry: Entry, reason: str, keep_warm: bool) -> None:
        await entry.idle.wait()
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
        victims = [self._detach(self._entries[k], "host_tier")
                   for k in tier.victims_for(nbytes)]  # fmt: skip
        fits = nbytes <= tier.free_bytes
        if fits:
            tier.add(entry.key, nbytes)
            tier.hold(entry.key)  # not droppable before its weights are there
        for victim, parked_backend, _ in victims:
            await self._dispose(victim, parked_backend, None)
        if not fits:
            return False
        try:
            await asyncio.to_thread(self._lifecycle.park, backend, device or "cpu")
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
        _, backend, device = self._detach(entry, reason)
        await self._dispose(entry, backend, device)

    def _detach(self, entry: Entry, reason: str) -> tuple[Entry, Backend | None, str | None]:
        """Take `entry`'s backend away (and its host-tier charge) at once; returns it with the
        device its memory is on (None: host memory) for `_dispose`."""
        backend, entry.backend = entry.backend, None
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
        try:
            await backend.aclose()
            await asyncio.to_thread(self._lifecycle.unload, backend, device, entry.measured_bytes)
        except Exception:
            log.exception("unloading %s failed; its memory may not be freed", entry.key)
        finally:
            del backend
            self._reports.update_gauges()
