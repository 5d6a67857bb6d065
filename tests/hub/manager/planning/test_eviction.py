"""Eviction policies and victim choice: who goes first, and never more than needed."""

from __future__ import annotations

import pytest

from hub.manager.planning.eviction import (
    Candidate,
    GreedyDualSizeFrequency,
    LargestFirst,
    LeastRecentlyUsed,
    choose_victims,
    make_policy,
)
from hub.manager.planning.keys import ModelKey
from hub.manager.planning.placement import place

pytestmark = pytest.mark.pure

MiB = 2**20


def cand(name: str, mib: int, last_used: float, reload_s: float = 1.0, hits: int = 1) -> Candidate:
    return Candidate(ModelKey(name, 1), "cpu", mib * MiB, last_used, reload_s, hits)


def names(cs: list[Candidate] | None) -> list[str]:
    assert cs is not None
    return [c.key.name for c in cs]


def test_lru_and_largest_orders() -> None:
    cs = [cand("old-small", 10, 1.0), cand("new-big", 50, 3.0), cand("mid", 30, 2.0)]
    assert names(LeastRecentlyUsed().order(cs)) == ["old-small", "mid", "new-big"]
    assert names(LargestFirst().order(cs)) == ["new-big", "mid", "old-small"]


def test_gdsf_keeps_models_that_are_expensive_to_reload_per_byte() -> None:
    policy = GreedyDualSizeFrequency()
    cheap = cand("cheap", 100, last_used=1.0, reload_s=0.05)  # restores from the warm tier
    costly = cand("costly", 100, last_used=0.0, reload_s=20.0)  # a cold load from disk
    for c in (costly, cheap):
        policy.on_access(c)
    # LRU would evict `costly` (used longer ago); GDSF evicts the cheap one first.
    assert names(policy.order([cheap, costly])) == ["cheap", "costly"]


def test_gdsf_ages_out_models_not_used_since_the_clock_rose() -> None:
    policy = GreedyDualSizeFrequency()
    a, b = cand("a", 10, 0.0, reload_s=2.0), cand("b", 10, 0.0, reload_s=1.0)
    policy.on_access(a)
    policy.on_access(b)
    policy.on_evict(b.key)  # the clock rises to b's value
    for _ in range(3):  # c is touched after the clock rose, with a lower cost than a
        c = cand("c", 10, 1.0, reload_s=1.5)
        policy.on_access(c)
        policy.on_evict(c.key)
    fresh = cand("fresh", 10, 2.0, reload_s=1.0)
    policy.on_access(fresh)
    # `a` was valued before the clock inflated past it: it goes before a fresh model.
    assert names(policy.order([fresh, a]))[0] == "a"


def test_choose_victims_spares_victims_a_larger_one_covers() -> None:
    ordered = [cand("small", 10, 1.0), cand("big", 100, 2.0), cand("other", 60, 3.0)]
    assert names(choose_victims(ordered, 90 * MiB)) == ["big"]
    assert names(choose_victims(ordered, 5 * MiB)) == ["small"]
    assert names(choose_victims(ordered, 105 * MiB)) == ["small", "big"]
    assert names(choose_victims(ordered, 115 * MiB)) == ["big", "other"]
    assert choose_victims(ordered, 200 * MiB) is None
    assert choose_victims(ordered, 0) == []


def test_place_prefers_a_fit_then_the_warm_device_then_best_fit() -> None:
    policy = make_policy("lru")
    free = {"cpu": 100 * MiB, "cuda:0": 60 * MiB, "cuda:1": 500 * MiB}
    devices = list(free)
    nothing: dict[str, list[Candidate]] = {d: [] for d in devices}
    need = dict.fromkeys(devices, 50 * MiB)
    plan = place(need, devices, free, nothing.__getitem__, policy)
    assert plan is not None and plan.device == "cuda:0" and not plan.victims  # tightest fit
    plan = place(need, devices, free, nothing.__getitem__, policy, prefer="cuda:1")
    assert plan is not None and plan.device == "cuda:1"  # where its warm copy came from
    # A footprint that depends on the device (a KV cache sized by the budget) changes the fit.
    plan = place({**need, "cuda:0": 70 * MiB}, devices, free, nothing.__getitem__, policy)
    assert plan is not None and plan.device == "cpu"
    full = {"cpu": 0, "cuda:0": 10 * MiB}
    victims = {"cpu": [cand("x", 80, 1.0, reload_s=5.0)], "cuda:0": [cand("y", 80, 1.0)]}
    plan = place(dict.fromkeys(full, 50 * MiB), list(full), full, victims.__getitem__, policy)
    assert plan is not None and plan.device == "cuda:0" and names(list(plan.victims)) == ["y"]
    huge = dict.fromkeys(full, 500 * MiB)
    assert place(huge, list(full), full, victims.__getitem__, policy) is None


def test_an_unknown_policy_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unknown eviction policy 'mru'.*'gdsf', 'largest', 'lru'"
    ):
        make_policy("mru")
    assert {make_policy(name).name for name in ("gdsf", "lru", "largest")} == {
        "gdsf",
        "lru",
        "largest",
    }
