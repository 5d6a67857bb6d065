"""What a heartbeat says about this replica, read from the manager's status on the event
loop (the manager's state belongs to it); the SQL write happens elsewhere, in a thread."""

from __future__ import annotations

from collections.abc import Iterable

from hub import __version__
from hub.manager import DeviceStatus, HostTierStatus, ModelStatus
from registry.replicas import ReplicaBeat

# Manager states worth telling peers about: on a device (or on its way to or from one), or
# parked warm in host memory. Failed and unloaded entries hold nothing.
HELD_STATES = frozenset({"loading", "loaded", "evicting", "warm"})


def queue_depth(models: Iterable[ModelStatus]) -> int:
    """Requests in flight (holding a model) plus requests waiting for a model to load."""
    return sum(m.in_flight + m.waiting for m in models)


def held_models(models: Iterable[ModelStatus]) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for m in models:
        if m.state not in HELD_STATES:
            continue
        warm = m.state == "warm"
        out.append(
            {
                "name": m.name,
                "version": m.version,
                "kind": m.kind,
                "state": m.state,
                "device": None if warm else m.device,
                "bytes": m.host_bytes if warm else max(m.measured_bytes, m.predicted_bytes),
                # What it takes on a device, also while it is parked warm: a peer that never
                # loaded this version sizes it by this before sending a load or restore here.
                "device_bytes": max(m.measured_bytes, m.predicted_bytes),
                "pinned": m.pinned,
                "in_flight": m.in_flight,
            }
        )
    return out


def build_beat(
    replica_id: str,
    address: str,
    models: list[ModelStatus],
    devices: list[DeviceStatus],
    host_tier: HostTierStatus,
) -> ReplicaBeat:
    return ReplicaBeat(
        id=replica_id,
        address=address,
        hub_version=__version__,
        models=held_models(models),
        devices=[
            {"name": d.name, "budget_bytes": d.budget_bytes, "free_bytes": d.free_bytes}
            for d in devices
        ],
        host_free_bytes=host_tier.free_bytes,
        queue_depth=queue_depth(models),
    )
