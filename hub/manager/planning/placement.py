"""Where a model goes: the device it fits best, evicting as little as the policy allows.

A device where the model fits in free memory beats one where something must be evicted;
among those the device it was on last wins when its copy is warm (its restore goes back where
it came from), then the tighter fit (best fit: the least memory left over, which keeps large
holes for large models). Where eviction is needed, the device whose victims are cheapest to
bring back wins. A deployment that names a device offers only that one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hub.manager.planning.dependents import riders_first
from hub.manager.planning.eviction import Candidate, EvictionPolicy, choose_victims


@dataclass(frozen=True)
class Placement:
    """A device for a load and what must leave it first."""

    device: str
    # Models to evict first; empty when the model fits in free memory.
    victims: tuple[Candidate, ...] = ()


def place(
    need: Mapping[str, int],
    devices: Sequence[str],
    free: Mapping[str, int],
    candidates: Callable[[str], list[Candidate]],
    policy: EvictionPolicy,
    *,
    prefer: str | None = None,
) -> Placement | None:
    """The best placement on one of `devices`, or None if no device can make room now.
    `need[device]` is the model's footprint there (an LLM's KV cache may be a share of the
    device's budget), `free` each device's free bytes (including memory already being freed
    for this model); `candidates(device)` lists what may be evicted there."""
    best: tuple[tuple[object, ...], Placement] | None = None
    for device in devices:
        available = free[device]
        n = need[device]
        if n <= available:
            rank: tuple[object, ...] = (0, device != prefer, 0.0, available - n)
            option = Placement(device)
        else:
            ordered = riders_first(policy.order(candidates(device)))
            victims = choose_victims(ordered, n - available)
            if victims is None:
                continue
            freed = sum(v.nbytes for v in victims)
            cost = sum(v.reload_s for v in victims)
            rank = (1, device != prefer, cost, available + freed - n)
            option = Placement(device, tuple(victims))
        if best is None or rank < best[0]:
            best = (rank, option)
    return best[1] if best is not None else None
