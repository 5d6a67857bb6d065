"""The ledger: bytes charged to each device, per model, never more than the device's budget.

A load reserves its predicted footprint before it starts, so concurrent loads can never
oversubscribe a device; once loaded the charge is settled to the larger of prediction and
measurement; an eviction releases it only after the memory is really freed. Every byte the
manager believes is in use on a device is a charge here, so "used" and "free" are read from
one place.
"""

from __future__ import annotations

from collections.abc import Mapping

from hub.manager.planning.keys import ModelKey
from hub.units import format_bytes


class OverBudget(RuntimeError):
    """A charge that would take a device past its budget: a bug in the caller, never a
    request's fault (callers check `free` first)."""


class MemoryLedger:
    """Bytes charged per device and model; `reserve` refuses to pass a device's budget, so
    the sum of a device's charges is never more than its budget."""

    def __init__(self, budgets: Mapping[str, int]) -> None:
        self._budgets = dict(budgets)
        self._charges: dict[str, dict[ModelKey, int]] = {name: {} for name in self._budgets}
        self._where: dict[ModelKey, str] = {}

    @property
    def devices(self) -> list[str]:
        return list(self._budgets)

    def budget(self, device: str) -> int:
        return self._budgets[device]

    def used(self, device: str) -> int:
        return sum(self._charges[device].values())

    def free(self, device: str) -> int:
        return self._budgets[device] - self.used(device)

    def charges(self, device: str) -> dict[ModelKey, int]:
        return dict(self._charges[device])

    def device_of(self, key: ModelKey) -> str | None:
        return self._where.get(key)

    def charge_of(self, key: ModelKey) -> int:
        device = self._where.get(key)
        return self._charges[device][key] if device is not None else 0

    def reserve(self, key: ModelKey, device: str, nbytes: int) -> None:
        """Add `nbytes` to `key`'s charge on `device`; refuse to pass the budget."""
        current = self._where.get(key)
        if current is not None and current != device:
            raise OverBudget(f"{key} is charged to {current}, cannot also charge {device}")
        if nbytes > self.free(device):
            raise OverBudget(
                f"charging {format_bytes(nbytes)} for {key} would take {device} past its budget "
                f"({format_bytes(self.free(device))} free of {format_bytes(self.budget(device))})"
            )
        self._charges[device][key] = self._charges[device].get(key, 0) + nbytes
        self._where[key] = device

    def shrink(self, key: ModelKey, nbytes: int) -> None:
        """Lower `key`'s charge to `nbytes` (a measurement below the reservation)."""
        device = self._where[key]
        self._charges[device][key] = min(self._charges[device][key], nbytes)

    def release(self, key: ModelKey) -> int:
        """Drop `key`'s charge; returns the bytes released (0 when it had none)."""
        device = self._where.pop(key, None)
        if device is None:
            return 0
        return self._charges[device].pop(key)
