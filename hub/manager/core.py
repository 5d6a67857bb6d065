"""The manager's state and the views over it that every part reads.

`ManagerCore` holds what the manager knows (one `Entry` per model version it has touched, the
device ledger, the host tier, the room broker, the eviction policy) and answers questions
about it: which models may be evicted from a device, what a model's status row says, what
each device holds. Loading (`loads.Loading`), evicting (`evicting.Evicting`) and the public
API (`manager.ModelManager`) build on it, in that order.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from hub.manager.devices import Device
from hub.manager.eviction import Candidate, make_policy
from hub.manager.footprint import Footprint
from hub.manager.host_tier import HostTier
from hub.manager.keep_alive import effective_keep_alive
from hub.manager.ledger import MemoryLedger
from hub.manager.loader import VersionLoader
from hub.manager.room import RoomBroker
from hub.manager.state import (
    DeviceStatus,
    Entry,
    HostTierStatus,
    ModelKey,
    ModelState,
    ModelStatus,
)
from hub.metrics import HubMetrics
from hub.settings import ManagerSettings, ModelSpec


class ManagerCore:
    def __init__(
        self,
        settings: ManagerSettings,
        devices: list[Device],
        loader: VersionLoader,
        metrics: HubMetrics,
        *,
        host_cache_budget: int = 0,
        model_specs: Mapping[str, ModelSpec] | None = None,
    ) -> None:
        self.settings = settings
        self.devices = devices
        self.loader = loader
        self.metrics = metrics
        self.ledger = MemoryLedger(devices)
        self.host_tier = HostTier(host_cache_budget)
        self.policy = make_policy(settings.eviction_policy)
        self.footprint = Footprint(devices, settings.load_overhead_bytes)
        self._budgets = {d.name: d.budget_bytes for d in devices}
        self._specs = dict(model_specs or {})
        self._broker = RoomBroker(self.ledger, self.policy)
        self._entries: dict[ModelKey, Entry] = {}
        self._failures: dict[ModelKey, tuple[int, float]] = {}  # key -> (count, retry at)

    # ---- entries --------------------------------------------------------------------------
    def entry(self, key: ModelKey) -> Entry | None:
        return self._entries.get(key)

    def _entry(self, key: ModelKey, kind: str) -> Entry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = Entry(key=key, kind=kind)
            entry.idle.set()
        return entry

    def is_pinned(self, key: ModelKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.pinned

    def _keep_alive_s(self, entry: Entry) -> float:
        deployment = entry.deployment.keep_alive if entry.deployment else None
        return effective_keep_alive(entry.keep_alive, deployment, self.settings.keep_alive)

    # ---- what may be evicted --------------------------------------------------------------
    def _candidates(self, device: str) -> list[Candidate]:
        """Models on `device` that may be evicted now: loaded, idle, nobody waiting for them,
        unpinned and past the minimum residency."""
        now = time.monotonic()
        out = []
        for key in self.ledger.charges(device):
            entry = self._entries[key]
            if (
                self._idle_loaded(entry)
                and not entry.pinned
                and entry.loaded_at is not None
                and now - entry.loaded_at >= self.settings.min_residency
            ):
                out.append(self._candidate(entry))
        return out

    @staticmethod
    def _idle_loaded(entry: Entry) -> bool:
        return entry.state is ModelState.LOADED and entry.in_flight == 0 and entry.waiting == 0

    def _candidate(self, entry: Entry) -> Candidate:
        nbytes = self.ledger.charge_of(entry.key)
        # Coming back is a restore if the host tier can take its weights, else a cold load.
        warm = entry.warm_load_s if self.host_tier.admits(nbytes) else None
        return Candidate(
            key=entry.key,
            device=entry.device or "",
            nbytes=nbytes,
            last_used=entry.last_used,
            reload_s=warm or entry.cold_load_s or 1.0,
            hits=entry.hits,
        )

    # ---- status ---------------------------------------------------------------------------
    def status(self) -> list[ModelStatus]:
        return [self._status(e) for _, e in sorted(self._entries.items())]

    def device_usage(self) -> dict[str, int]:
        return {d.name: self.ledger.used(d.name) for d in self.devices}

    def device_status(self) -> list[DeviceStatus]:
        out = []
        for d in self.devices:
            charges = self.ledger.charges(d.name)
            pinned = sum(n for k, n in charges.items() if self.is_pinned(k))
            used = sum(charges.values())
            out.append(DeviceStatus(d.name, d.budget_bytes, used, d.budget_bytes - used,
                                    pinned, len(charges)))  # fmt: skip
        return out

    def host_tier_status(self) -> HostTierStatus:
        tier = self.host_tier
        return HostTierStatus(
            budget_bytes=tier.budget_bytes,
            used_bytes=tier.used_bytes,
            free_bytes=tier.free_bytes,
            models=len(tier),
            pinned_memory=any(d.is_cuda for d in self.devices),
        )

    def _status(self, e: Entry) -> ModelStatus:
        now = time.monotonic()
        return ModelStatus(
            name=e.key.name,
            version=e.key.version,
            kind=e.kind,
            state=e.state.value,
            device=e.device,
            predicted_bytes=e.predicted_bytes,
            measured_bytes=e.measured_bytes if e.backend is not None else 0,
            pinned=e.pinned,
            in_flight=e.in_flight,
            waiting=e.waiting,
            last_used_s_ago=round(now - e.last_used, 3),
            error=e.error,
            host_bytes=e.host_bytes,
            keep_alive_s=self._keep_alive_s(e),
            keep_alive_expires_in_s=(
                round(max(0.0, e.expires_at - now), 3) if e.expires_at is not None else None
            ),
            last_device=e.last_device,
            cold_load_s=e.cold_load_s,
            warm_load_s=e.warm_load_s,
        )

    @staticmethod
    def _labels(entry: Entry) -> tuple[str, str]:
        return entry.key.name, str(entry.key.version)

    def _update_gauges(self) -> None:
        for status in self.device_status():
            self.metrics.resident_bytes.labels(status.name).set(status.used_bytes)
            self.metrics.loaded_models.labels(status.name).set(status.models)
        self.metrics.host_tier_bytes.set(self.host_tier.used_bytes)
        self.metrics.host_tier_models.set(len(self.host_tier))
