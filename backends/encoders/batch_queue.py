"""Which pooled input seeds the next batch: the oldest of the best-ranked priority level.

The dynamic batcher (backends.encoders.batching) grows each batch around one seed input. The
seed is the oldest pooled input of the lowest aged level (`backends.priority`: interactive -1,
standard 0, batch 1), so an interactive request goes into the next batch ahead of any batch-
class inputs queued before it. An input gains one level per `aging_batches` batches taken
while it waits, so batch-class work is never starved: once it has waited twice that many
batches it ties a fresh interactive input and, being older, seeds first. Not thread-safe:
the batcher calls it under its lock.
"""

from __future__ import annotations

from collections import deque
from typing import Generic

from backends.encoders.batch_items import I, PooledInput
from backends.priority import aged_level


class SeedQueue(Generic[I]):
    """Pooled inputs in arrival order, one queue per priority level. Inputs taken into a
    batch out of order (as neighbours of a seed) are marked `taken` and skipped lazily."""

    def __init__(self, aging_batches: int) -> None:
        if aging_batches < 1:
            raise ValueError(f"aging_batches must be at least 1, got {aging_batches}")
        self.aging_batches = aging_batches
        # level -> (slot, batches taken before it was pooled), oldest first.
        self._queues: dict[int, deque[tuple[PooledInput[I], int]]] = {}
        self._batches = 0

    def __bool__(self) -> bool:
        return bool(self._queues)

    def append(self, slot: PooledInput[I], level: int) -> None:
        self._queues.setdefault(level, deque()).append((slot, self._batches))

    def batch_taken(self) -> None:
        """A batch left the pool: everything still waiting ages by one batch."""
        self._batches += 1

    def seed(self) -> PooledInput[I] | None:
        """The oldest untaken input of the best aged level (FCFS across levels on a tie)."""
        best: tuple[int, int] | None = None
        chosen: PooledInput[I] | None = None
        for level in list(self._queues):
            queue = self._queues[level]
            while queue and queue[0][0].taken:
                queue.popleft()
            if not queue:
                del self._queues[level]
                continue
            slot, pooled_at = queue[0]
            rank = (aged_level(level, self._batches - pooled_at, self.aging_batches), slot.key[1])
            if best is None or rank < best:
                best, chosen = rank, slot
        return chosen

    def clear(self) -> None:
        self._queues.clear()
