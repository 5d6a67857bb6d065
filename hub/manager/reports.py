"""The manager's read side: status rows for `/admin/models` and `/admin/devices`, and the
residency gauges, all read from the entries and the planner's ledger and host tier."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from hub.manager.devices import Device
from hub.manager.planning import ModelKey, Planner
from hub.manager.state import DeviceStatus, Entry, HostTierStatus, ModelStatus
from hub.metrics import HubMetrics


class StatusReports:
    """Builds status rows and keeps the gauges current; reads, never changes, the state."""

    def __init__(
        self,
        devices: Sequence[Device],
        entries: Mapping[ModelKey, Entry],
        planner: Planner,
        metrics: HubMetrics,
        default_keep_alive: float,
    ) -> None:
        self._devices = devices
        self._entries = entries
        self._planner = planner
        self._metrics = metrics
        self._default_keep_alive = default_keep_alive

    def models(self) -> list[ModelStatus]:
        return [self.model(e) for _, e in sorted(self._entries.items())]

    def model(self, e: Entry) -> ModelStatus:
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
            keep_alive_s=e.keep_alive_s(self._default_keep_alive),
            keep_alive_expires_in_s=(
                round(max(0.0, e.expires_at - now), 3) if e.expires_at is not None else None
            ),
            last_device=e.last_device,
            cold_load_s=e.cold_load_s,
            warm_load_s=e.warm_load_s,
            base=str(e.base) if e.base is not None else None,
            adapters=tuple(map(str, self._planner.adapters_on(e.key))),
            worker_pids=tuple(e.backend.worker_pids()) if e.backend is not None else (),
        )

    def devices(self) -> list[DeviceStatus]:
        out = []
        ledger = self._planner.ledger
        for d in self._devices:
            charges = ledger.charges(d.name)
            pinned = sum(n for k, n in charges.items() if self._pinned(k))
            used = sum(charges.values()) + d.context_bytes
            lost = self._planner.lost.get(d.name)
            out.append(DeviceStatus(d.name, d.budget_bytes, used, d.budget_bytes - used,
                                    pinned, len(charges), context_bytes=d.context_bytes,
                                    usable=lost is None, error=lost))  # fmt: skip
        return out

    def host_tier(self) -> HostTierStatus:
        tier = self._planner.host_tier
        return HostTierStatus(
            budget_bytes=tier.budget_bytes,
            used_bytes=tier.used_bytes,
            free_bytes=tier.free_bytes,
            models=len(tier),
            pinned_memory=any(d.is_cuda for d in self._devices),
        )

    def update_gauges(self) -> None:
        for status in self.devices():
            self._metrics.resident_bytes.labels(status.name).set(status.used_bytes)
            self._metrics.loaded_models.labels(status.name).set(status.models)
        self._metrics.host_tier_bytes.set(self._planner.host_tier.used_bytes)
        self._metrics.host_tier_models.set(len(self._planner.host_tier))

    def _pinned(self, key: ModelKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.pinned


def labels(entry: Entry) -> tuple[str, str]:
    """The (model, version) metric labels of `entry`."""
    return entry.key.name, str(entry.key.version)
