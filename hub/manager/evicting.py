"""Moving models off their devices: for room, when their keep-alive runs out, or by an admin.

An eviction waits for the model's requests in flight to finish (those chosen for room are
already idle), then parks its weights in the host tier when they fit there (dropping the
tier's least recently used models if needed) or unloads it for good. The device's ledger
charge is released only once the memory is free, and the room broker is pumped right away so
a waiting load takes the room at once. The keep-alive timer and the pump live here too: they
are what starts evictions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from backends.base import Backend
from hub.manager.core import ManagerCore
from hub.manager.keep_alive import FOREVER, Reaper
from hub.manager.state import Entry, ModelKey, ModelState

log = logging.getLogger(__name__)


class Evicting(ManagerCore):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reaper = Reaper(self.settings.idle_check_interval, self._tick)

    def _start_eviction(
        self, entry: Entry, reason: str, *, keep_warm: bool = True
    ) -> asyncio.Task[None]:
        """Move `entry` off its device once its requests finish: parked in the host tier when
        `keep_warm` and it fits there, dropped otherwise. The state changes at once, so
        nothing else picks it or serves from it meanwhile."""
        if entry.evict_task is not None and not entry.evict_task.done():
            return entry.evict_task
        entry.state = ModelState.EVICTING
        entry.expires_at = None
        if reason == "pressure":
            self.policy.on_evict(entry.key)
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
                await self._drop(entry, reason)
        finally:
            self.ledger.release(entry.key)
            entry.device = None
            entry.state = ModelState.WARM if parked else ModelState.UNLOADED
            self.metrics.evictions.labels(*self._labels(entry), reason).inc()
            log.info("%s left %s (%s)%s", entry.key, device, reason,
                     ", parked in the host tier" if parked else "")  # fmt: skip
            self._update_gauges()
            self._pump()

    async def _park(self, entry: Entry, backend: Backend, device: str | None) -> bool:
        """Offload into the host tier, dropping its least recently used models for room;
        False when the weights do not fit there."""
        nbytes = backend.offload_bytes()
        if not self.host_tier.admits(nbytes):
            return False
        # Victims leave and the room is taken before any await, so a concurrent eviction
        # cannot take the same room and a dropped model cannot start a restore meanwhile.
        victims = [self._detach(self._entries[k], "host_tier")
                   for k in self.host_tier.victims_for(nbytes)]  # fmt: skip
        fits = nbytes <= self.host_tier.free_bytes
        if fits:
            self.host_tier.add(entry.key, nbytes)
            self.host_tier.hold(entry.key)  # not droppable before its weights are there
        for victim, parked_backend, _ in victims:
            await self._dispose(victim, parked_backend, None)
        if not fits:
            return False
        try:
            await asyncio.to_thread(self.footprint.offload, backend, device or "cpu")
        except Exception as e:
            log.error("offloading %s failed, dropping it instead: %r", entry.key, e)
            self.host_tier.remove(entry.key)
            return False
        self.host_tier.unhold(entry.key)
        entry.host_bytes = nbytes
        return True

    async def _drop(self, entry: Entry, reason: str) -> None:
        """Unload `entry` for good, whichever copy it has (device or parked). The caller
        releases any device charge; a parked copy's host-tier charge is released here."""
        _, backend, device = self._detach(entry, reason)
        await self._dispose(entry, backend, device)

    def _detach(self, entry: Entry, reason: str) -> tuple[Entry, Backend | None, str | None]:
        """Take `entry`'s backend away (and its host-tier charge) at once; returns it with the
        device its memory is on (None: host memory) for `_dispose`."""
        backend, entry.backend = entry.backend, None
        parked = self.host_tier.remove(entry.key) > 0
        entry.host_bytes = 0
        if entry.state is ModelState.WARM:
            entry.state = ModelState.UNLOADED
            self.metrics.evictions.labels(*self._labels(entry), reason).inc()
        self.policy.forget(entry.key)
        return entry, backend, None if parked else entry.device

    async def _dispose(self, entry: Entry, backend: Backend | None, device: str | None) -> None:
        """Stop the backend's workers, then unload it in a worker thread."""
        if backend is None:
            return
        try:
            await backend.aclose()
            await asyncio.to_thread(self.footprint.dispose, backend, device, entry.measured_bytes)
        except Exception:
            log.exception("unloading %s failed; its memory may not be freed", entry.key)
        finally:
            del backend
            self._update_gauges()

    # ---- what starts evictions ------------------------------------------------------------
    def _pump(self) -> None:
        """Let the room broker grant what fits now and start the evictions it chose."""
        for key, _device in self._broker.pump(self._candidates, self._leaving):
            self._start_eviction(self._entries[key], "pressure")

    def _leaving(self, key: ModelKey) -> bool:
        return self._entries[key].state is ModelState.EVICTING

    def _arm_keep_alive(self, entry: Entry) -> None:
        """Start the idle clock of a loaded, idle model (keep-alive 0: evict now)."""
        keep_alive = self._keep_alive_s(entry)
        entry.expires_at = None
        if entry.pinned or keep_alive == FOREVER:
            return
        if keep_alive == 0:
            self._start_eviction(entry, "keep_alive")
            return
        entry.expires_at = time.monotonic() + keep_alive
        self._reaper.poke()

    def _tick(self) -> float | None:
        """Evict models whose keep-alive ran out and retry waiting loads; returns when to
        look again: the next expiry, or, while loads wait for room, the next model to pass
        its minimum residency."""
        now = time.monotonic()
        next_at: float | None = None
        for entry in list(self._entries.values()):
            if entry.expires_at is None or entry.pinned or not self._idle_loaded(entry):
                continue
            if entry.expires_at <= now:
                self._start_eviction(entry, "keep_alive")
            else:
                next_at = min(next_at or entry.expires_at, entry.expires_at)
        if self._broker.pending:
            self._pump()
            for entry in self._entries.values():
                if self._idle_loaded(entry) and not entry.pinned and entry.loaded_at is not None:
                    eligible = entry.loaded_at + self.settings.min_residency
                    if eligible > now:
                        next_at = min(next_at or eligible, eligible)
        return next_at
