"""Which adapter holds which device slot: a fixed number of slots, least recently used out.

Pure Python (no torch): `LoRAManager` asks `assign` for the adapters of a step and copies the
weights of each new placement into its slot; an adapter pushed out of its slot keeps its host
copy and comes back on its next step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """`key` now occupies `slot`; `evicted` held it before (None: the slot was free)."""

    slot: int
    key: str
    evicted: str | None


class SlotTable:
    """`num_slots` device slots over adapter keys. `assign(keys)` gives every key of one step a
    slot, evicting only the least recently used adapters outside `keys`; asking for more keys
    than slots is a ValueError (the scheduler never schedules that many)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"need at least one adapter slot, got {num_slots}")
        self.num_slots = num_slots
        # key -> slot, least recently used first.
        self._slots: OrderedDict[str, int] = OrderedDict()

    @property
    def resident(self) -> list[str]:
        return list(self._slots)

    def assign(self, keys: Collection[str]) -> list[Placement]:
        """Slots for all `keys` (each marked used now); the placements that need a copy."""
        if len(set(keys)) > self.num_slots:
            raise ValueError(f"{len(set(keys))} adapters in one step; only {self.num_slots} slots")
        placements = []
        for key in keys:
            if key in self._slots:
                self._slots.move_to_end(key)
        free = sorted(set(range(self.num_slots)) - set(self._slots.values()), reverse=True)
        for key in keys:
            if key in self._slots:
                continue
            evicted = None
            if free:
                slot = free.pop()
            else:
                # The least recently used adapter not needed now (those were moved to the end).
                evicted, slot = next(iter(self._slots.items()))
                del self._slots[evicted]
            self._slots[key] = slot
            placements.append(Placement(slot, key, evicted))
        return placements

    def drop(self, key: str) -> int | None:
        """Free `key`'s slot, if it has one; returns the slot."""
        return self._slots.pop(key, None)

    def clear(self) -> None:
        self._slots.clear()
