"""Explaining memory pressure: whether waiting can help, and who holds the memory.

A load that cannot fit even after evicting everything evictable is refused at once rather
than after the load timeout: `too_large` when the model exceeds every allowed device's budget,
`pinned_full` when the pinned models leave too little. A load that times out waiting for room
says, per device, what it needed, what was free, and each model holding memory with the
reason it could not be evicted (requests in flight, pinned, loading, younger than the minimum
residency), so an operator can act on the 503. The inputs are the ledger and a read-only view
of the models; `NoRoom` carries the code the manager's 503 (or 409 for a pin) answers with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from hub.manager.planning.dependents import held_by_adapters
from hub.manager.planning.keys import ModelKey
from hub.manager.planning.ledger import MemoryLedger
from hub.manager.planning.occupants import Occupant, why_held
from hub.units import format_bytes

if TYPE_CHECKING:
    from hub.manager.planning.room import RoomRequest


class NoRoom(Exception):
    """No device memory for a load; `code` is the error code the 503 carries."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def check_feasible(
    key: ModelKey,
    need: Mapping[str, int],
    ledger: MemoryLedger,
    occupants: Mapping[ModelKey, Occupant],
) -> None:
    """Raise NoRoom when no device could ever hold `need[device]` bytes for `key` without
    evicting a pinned model."""
    if all(n > ledger.budget(d) for d, n in need.items()):
        budgets = ", ".join(f"{d} {format_bytes(ledger.budget(d))}" for d in need)
        raise NoRoom(
            f"{key} needs {needs_text(need)}, more than the whole budget of any device "
            f"it may use ({budgets}); raise the budget or place it on a larger device",
            code="too_large",
        )

    def pinned(k: ModelKey) -> bool:
        other = occupants.get(k)
        return k != key and other is not None and other.pinned

    room = {d: ledger.budget(d) - sum(n for k, n in ledger.charges(d).items() if pinned(k))
            for d in need}  # fmt: skip
    if all(need[d] > r for d, r in room.items()):
        held = "; ".join(
            holders(key, d, ledger, occupants, now=0.0, min_residency=0.0, pinned_only=True)
            for d in need
        )
        raise NoRoom(
            f"{key} needs {needs_text(need)} but pinned models leave too little room "
            f"({held}); unpin a model or raise the budget",
            code="pinned_full",
        )


def needs_text(need: Mapping[str, int]) -> str:
    """'40.0 MiB', or '40.0 MiB on cpu, 1.2 GiB on cuda:0' when it differs by device."""
    if len(set(need.values())) == 1:
        return format_bytes(next(iter(need.values())))
    return ", ".join(f"{format_bytes(n)} on {d}" for d, n in need.items())


def describe_room(
    request: RoomRequest | None,
    ledger: MemoryLedger,
    occupants: Mapping[ModelKey, Occupant],
    *,
    now: float,
    min_residency: float,
) -> str:
    """'; on cpu: needs 40.0 MiB, 10.0 MiB free of 100.0 MiB, held by a@1 (...), ...' for a
    load still waiting for room; '' when it is not waiting."""
    if request is None:
        return ""
    devices = (request.device,) if request.device is not None else request.devices
    parts = []
    for d in devices:
        parts.append(
            f"on {d}: needs {format_bytes(request.need[d])}, {format_bytes(ledger.free(d))} "
            f"free of {format_bytes(ledger.budget(d))}, "
            + holders(request.key, d, ledger, occupants, now=now, min_residency=min_residency)
        )
    return "; " + "; ".join(parts)


def holders(
    key: ModelKey,
    device: str,
    ledger: MemoryLedger,
    occupants: Mapping[ModelKey, Occupant],
    *,
    now: float,
    min_residency: float,
    pinned_only: bool = False,
) -> str:
    """'held by a@1 (60.0 MiB, 1 request in flight), ...': the models other than `key`
    charged to `device`, largest first, each with why it stays."""
    held = []
    for other_key, nbytes in sorted(ledger.charges(device).items(), key=lambda kv: -kv[1]):
        other = occupants.get(other_key)
        if other_key == key or other is None or (pinned_only and not other.pinned):
            continue
        why = held_by_adapters(other_key, occupants) or why_held(other, now, min_residency)
        held.append(f"{other_key} ({format_bytes(nbytes)}, {why})")
    return "held by " + (", ".join(held) if held else "nothing")
