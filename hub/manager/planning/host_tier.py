"""The warm tier: evicted models' weights parked in host memory under their own budget.

A model evicted from its device parks its weights here when they fit, so bringing it back is
a memory copy rather than a disk load; when the tier is full the least recently used parked
models are dropped (their next load is cold, from the verified local artifact cache). A
parked model being restored is held and never chosen for dropping. The tier only keeps the
accounting; the weights live in the backends (`backends.parking`).
"""

from __future__ import annotations

from collections import OrderedDict

from hub.manager.planning.keys import ModelKey


class HostTier:
    """Accounting of the parked weights: what is parked, its bytes, in least-recently-parked
    order, and which parked models are held (being restored or parked) and never dropped."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        # Least recently used first.
        self._parked: OrderedDict[ModelKey, int] = OrderedDict()
        self._held: set[ModelKey] = set()

    @property
    def used_bytes(self) -> int:
        return sum(self._parked.values())

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def __contains__(self, key: object) -> bool:
        return key in self._parked

    def __len__(self) -> int:
        return len(self._parked)

    def admits(self, nbytes: int) -> bool:
        """Whether weights of `nbytes` could ever be parked (dropping everything else)."""
        held = sum(self._parked[k] for k in self._held if k in self._parked)
        return nbytes <= self.budget_bytes - held

    def victims_for(self, nbytes: int) -> list[ModelKey]:
        """Parked models to drop, least recently used first, so `nbytes` fit."""
        victims: list[ModelKey] = []
        free = self.free_bytes
        for key, size in self._parked.items():
            if free >= nbytes:
                break
            if key not in self._held:
                victims.append(key)
                free += size
        return victims if free >= nbytes else []

    def add(self, key: ModelKey, nbytes: int) -> None:
        if nbytes > self.free_bytes:
            raise RuntimeError(f"the host tier has no room for {key}; drop victims first")
        self._parked[key] = nbytes
        self._parked.move_to_end(key)

    def hold(self, key: ModelKey) -> None:
        """Protect a parked model from dropping while it is being restored."""
        self._held.add(key)

    def unhold(self, key: ModelKey) -> None:
        self._held.discard(key)

    def remove(self, key: ModelKey) -> int:
        self._held.discard(key)
        return self._parked.pop(key, 0)
