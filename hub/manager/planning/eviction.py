"""Which idle models to evict when a load needs room: the policies and the victim choice.

The manager offers only models that may go (loaded, idle, unpinned, nobody waiting, past the
minimum residency); a policy orders them, cheapest to lose first, and `choose_victims` takes
the shortest prefix of that order that frees enough, then gives back any victim the others
already cover (a least-recently-used small model is spared when the large one after it frees
enough alone).

- `gdsf` (default), GreedyDual-Size-Frequency: a model's value is `clock + hits x reload
  seconds / size`; the least valuable goes first and the clock rises to its value, so models
  not used for a while age out (recency) unless they are costly to bring back per byte, or
  popular. A model that reloads from the warm tier in 50 ms is cheaper to lose than one that
  takes 20 s from disk.
- `lru`: least recently used first (ModelMesh, Ollama).
- `largest`: largest first, least recently used among equals: fewest evictions per byte.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from hub.manager.planning.keys import ModelKey

_MIB = 2**20


@dataclass(frozen=True)
class Candidate:
    """A model that could be evicted, as the policies see it."""

    key: ModelKey
    device: str
    # Bytes its eviction frees on the device.
    nbytes: int
    # Monotonic time of its last use.
    last_used: float
    # Seconds it would take to bring it back.
    reload_s: float
    # Requests served since it was loaded.
    hits: int
    # A LoRA adapter's base: the base is offered after its adapters (`dependents`).
    base: ModelKey | None = None


class EvictionPolicy(Protocol):
    """Orders eviction candidates, cheapest to lose first; may keep state per model."""

    name: str

    def on_access(self, candidate: Candidate) -> None:
        """A request used the model (also called once when it is loaded)."""

    def on_evict(self, key: ModelKey) -> None:
        """The model was chosen as a victim."""

    def forget(self, key: ModelKey) -> None:
        """The model is gone for good (unloaded); drop any state kept for it."""

    def order(self, candidates: Iterable[Candidate]) -> list[Candidate]:
        """Candidates, the one to evict first first."""


class LeastRecentlyUsed:
    """Least recently used first; keeps no state."""

    name = "lru"

    def on_access(self, candidate: Candidate) -> None:
        pass

    def on_evict(self, key: ModelKey) -> None:
        pass

    def forget(self, key: ModelKey) -> None:
        pass

    def order(self, candidates: Iterable[Candidate]) -> list[Candidate]:
        return sorted(candidates, key=lambda c: (c.last_used, c.key))


class LargestFirst(LeastRecentlyUsed):
    """Largest first, least recently used among equals."""

    name = "largest"

    def order(self, candidates: Iterable[Candidate]) -> list[Candidate]:
        return sorted(candidates, key=lambda c: (-c.nbytes, c.last_used, c.key))


class GreedyDualSizeFrequency:
    """GreedyDual-Size with frequency (Cherkasova 1998), cost = measured reload seconds."""

    name = "gdsf"

    def __init__(self) -> None:
        self._clock = 0.0
        self._value: dict[ModelKey, float] = {}

    def value(self, candidate: Candidate) -> float:
        return self._value.get(candidate.key, self._fresh(candidate))

    def on_access(self, candidate: Candidate) -> None:
        self._value[candidate.key] = self._fresh(candidate)

    def on_evict(self, key: ModelKey) -> None:
        # Inflating the clock to the victim's value is what ages the models left behind.
        self._clock = max(self._clock, self._value.pop(key, self._clock))

    def forget(self, key: ModelKey) -> None:
        self._value.pop(key, None)

    def order(self, candidates: Iterable[Candidate]) -> list[Candidate]:
        return sorted(candidates, key=lambda c: (self.value(c), c.last_used, c.key))

    def _fresh(self, c: Candidate) -> float:
        return self._clock + max(1, c.hits) * c.reload_s / max(c.nbytes / _MIB, 1e-6)


POLICIES: dict[str, type[EvictionPolicy]] = {
    "gdsf": GreedyDualSizeFrequency,
    "lru": LeastRecentlyUsed,
    "largest": LargestFirst,
}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by its settings name (`gdsf`, `lru`, `largest`); ValueError otherwise."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; use one of {sorted(POLICIES)}"
        ) from None


def choose_victims(ordered: list[Candidate], need: int) -> list[Candidate] | None:
    """The victims, in policy order, that free at least `need` bytes, or None if all of
    `ordered` would not. Victims made redundant by later (larger) ones are spared."""
    if need <= 0:
        return []
    chosen: list[Candidate] = []
    freed = 0
    for candidate in ordered:
        if freed >= need:
            break
        chosen.append(candidate)
        freed += candidate.nbytes
    if freed < need:
        return None
    # The policy would rather keep the later victims; spare each one the rest still cover.
    for candidate in reversed(chosen[:-1]):
        if freed - candidate.nbytes >= need:
            chosen.remove(candidate)
            freed -= candidate.nbytes
    return chosen
