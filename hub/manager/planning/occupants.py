"""What the planner reads about a model holding device memory, and the rules over it.

The manager's entries satisfy `Occupant` as they are (the planner reads, never writes, them).
`evictable` is the one rule for what may be evicted for room: loaded, no request in flight,
nobody waiting for it, unpinned, and resident for at least the minimum residency. `why_held`
says in words why a model is not evictable, for the 503 that names what holds the memory.
"""

from __future__ import annotations

from typing import Protocol

from hub.manager.planning.keys import ModelKey
from hub.manager.residency import ModelState


class Occupant(Protocol):
    """A model version as the planner sees it (read-only)."""

    @property
    def key(self) -> ModelKey: ...
    @property
    def state(self) -> ModelState: ...
    @property
    def pinned(self) -> bool: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    # Monotonic time it became resident; None while not resident.
    @property
    def loaded_at(self) -> float | None: ...
    @property
    def last_used(self) -> float: ...
    # Requests served since it was last loaded.
    @property
    def hits(self) -> int: ...
    # Measured seconds of its last cold load and warm restore; None before the first.
    @property
    def cold_load_s(self) -> float | None: ...
    @property
    def warm_load_s(self) -> float | None: ...
    # A LoRA adapter's base model version (see `dependents`); None for a full model.
    @property
    def base(self) -> ModelKey | None: ...


def idle_loaded(o: Occupant) -> bool:
    """Resident, with no request in flight and nobody waiting for it."""
    return o.state is ModelState.LOADED and o.in_flight == 0 and o.waiting == 0


def evictable(o: Occupant, now: float, min_residency: float) -> bool:
    """Whether `o` may be evicted for room now."""
    return (
        idle_loaded(o)
        and not o.pinned
        and o.loaded_at is not None
        and now - o.loaded_at >= min_residency
    )


def why_held(o: Occupant, now: float, min_residency: float) -> str:
    """Why `o` cannot be evicted now ('idle' when it can)."""
    if o.pinned:
        return "pinned"
    if o.in_flight:
        return f"{o.in_flight} request{'s' if o.in_flight != 1 else ''} in flight"
    if o.state is not ModelState.LOADED:
        return o.state.value
    if o.waiting:
        return f"{o.waiting} waiting for it"
    if o.loaded_at is not None and now - o.loaded_at < min_residency:
        return f"loaded {now - o.loaded_at:.1f}s ago, under the minimum residency"
    return "idle"
