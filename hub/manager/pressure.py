"""Explaining memory pressure: whether waiting can help, and who holds the memory.

A load that cannot fit even after evicting everything evictable is refused at once rather
than after the load timeout: `too_large` when the model exceeds every allowed device's budget,
`pinned_full` when the pinned models leave too little. A load that times out waiting for room
says, per device, what it needed, what was free, and each model holding memory with the
reason it could not be evicted (requests in flight, pinned, loading, younger than the minimum
residency), so an operator can act on the 503.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from hub.manager.state import Entry, ModelState
from hub.units import format_bytes

if TYPE_CHECKING:
    from hub.manager.core import ManagerCore


class NoRoom(Exception):
    """No device memory for a load; `code` is the error code the 503 carries."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def feasibility(core: ManagerCore, entry: Entry, need: Mapping[str, int]) -> None:
    """Raise NoRoom when no device could ever hold `need[device]` bytes for `entry` without
    evicting a pinned model."""
    ledger = core.ledger
    if all(n > ledger.budget(d) for d, n in need.items()):
        budgets = ", ".join(f"{d} {format_bytes(ledger.budget(d))}" for d in need)
        raise NoRoom(
            f"{entry.key} needs {needs_text(need)}, more than the whole budget of any device "
            f"it may use ({budgets}); raise the budget or place it on a larger device",
            code="too_large",
        )
    room = {}
    for d in need:
        pinned = sum(
            n for k, n in ledger.charges(d).items() if k != entry.key and core.is_pinned(k)
        )
        room[d] = ledger.budget(d) - pinned
    if all(need[d] > r for d, r in room.items()):
        held = "; ".join(_holders(core, entry, d, pinned_only=True) for d in need)
        raise NoRoom(
            f"{entry.key} needs {needs_text(need)} but pinned models leave too little room "
            f"({held}); unpin a model or raise the budget",
            code="pinned_full",
        )


def needs_text(need: Mapping[str, int]) -> str:
    """'40.0 MiB', or '40.0 MiB on cpu, 1.2 GiB on cuda:0' when it differs by device."""
    if len(set(need.values())) == 1:
        return format_bytes(next(iter(need.values())))
    return ", ".join(f"{format_bytes(n)} on {d}" for d, n in need.items())


def describe_room(core: ManagerCore, entry: Entry) -> str:
    """'; on cpu: needs 40.0 MiB, 10.0 MiB free of 100.0 MiB, held by a@1 (...), ...'"""
    req = entry.room
    if req is None:
        return ""
    devices = (req.device,) if req.device is not None else req.devices
    parts = []
    for d in devices:
        parts.append(
            f"on {d}: needs {format_bytes(req.need[d])}, {format_bytes(core.ledger.free(d))} free "
            f"of {format_bytes(core.ledger.budget(d))}, {_holders(core, entry, d)}"
        )
    return "; " + "; ".join(parts)


def _holders(core: ManagerCore, entry: Entry, device: str, *, pinned_only: bool = False) -> str:
    now = time.monotonic()
    held = []
    for key, nbytes in sorted(core.ledger.charges(device).items(), key=lambda kv: -kv[1]):
        other = core.entry(key)
        if key == entry.key or other is None or (pinned_only and not other.pinned):
            continue
        held.append(f"{key} ({format_bytes(nbytes)}, {_why_held(core, other, now)})")
    return "held by " + (", ".join(held) if held else "nothing")


def _why_held(core: ManagerCore, e: Entry, now: float) -> str:
    if e.pinned:
        return "pinned"
    if e.in_flight:
        return f"{e.in_flight} request{'s' if e.in_flight != 1 else ''} in flight"
    if e.state is not ModelState.LOADED:
        return e.state.value
    if e.waiting:
        return f"{e.waiting} waiting for it"
    if e.loaded_at is not None and now - e.loaded_at < core.settings.min_residency:
        return f"loaded {now - e.loaded_at:.1f}s ago, under the minimum residency"
    return "idle"
