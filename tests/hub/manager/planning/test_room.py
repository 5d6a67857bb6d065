"""The room broker through the planner: grants first come, first served; evicts only idle,
unpinned models past their minimum residency (never one in flight); keeps the room being
freed for the request it is freed for."""

from __future__ import annotations

import asyncio

import pytest

from hub.manager.planning import ModelKey, Planner
from hub.manager.residency import ModelState
from tests.hub.manager.planning.support import Clock, MiB, Model, key, resident

pytestmark = pytest.mark.pure


def planner(models: dict[ModelKey, Model], clock: Clock, *, budget_mib: int = 100,
            min_residency: float = 0.0, policy: str = "lru") -> Planner:  # fmt: skip
    return Planner({"cpu": budget_mib * MiB}, models, policy=policy,
                   min_residency=min_residency, clock=clock)  # fmt: skip


async def test_requests_that_fit_are_granted_in_order_and_charged() -> None:
    models: dict[ModelKey, Model] = {}
    p = planner(models, Clock())
    first = p.request_room(key("a"), {"cpu": 60 * MiB})
    second = p.request_room(key("b"), {"cpu": 60 * MiB})
    third = p.request_room(key("c"), {"cpu": 30 * MiB})
    assert p.pump() == []
    assert first.granted.result() == "cpu" and p.ledger.charge_of(key("a")) == 60 * MiB
    # b cannot be helped now (nothing is evictable) and holds nothing: c, behind it, fits.
    assert not second.granted.done() and third.granted.result() == "cpu"
    assert p.ledger.used("cpu") == 90 * MiB and p.broker.pending == [second]
    p.ledger.release(key("a"))
    assert p.pump() == [] and await second.granted == "cpu"
    assert p.ledger.used("cpu") == 90 * MiB


async def test_only_idle_unpinned_models_past_min_residency_are_evicted() -> None:
    clock = Clock(now=100.0)
    models: dict[ModelKey, Model] = {}
    p = planner(models, clock, budget_mib=100, min_residency=5.0)
    resident(p, models, "in-flight", 15, in_flight=1, loaded_at=0.0)
    resident(p, models, "pinned", 15, pinned=True, loaded_at=0.0)
    resident(p, models, "young", 15, loaded_at=98.0)  # 2 s ago, minimum 5 s
    resident(p, models, "awaited", 15, waiting=2, loaded_at=0.0)
    resident(p, models, "loading", 15, state=ModelState.LOADING, loaded_at=None)
    resident(p, models, "idle", 15, loaded_at=0.0)
    assert [c.key for c in p.candidates("cpu")] == [key("idle")]

    # 10 MiB free; a 20 MiB load evicts the one idle model, nothing else.
    request = p.request_room(key("new"), {"cpu": 20 * MiB})
    assert p.pump() == [(key("idle"), "cpu")]
    models[key("idle")].state = ModelState.EVICTING  # the manager starts the eviction
    assert p.pump() == [] and not request.granted.done()  # waits for it to leave
    p.ledger.release(key("idle"))
    models[key("idle")].state = ModelState.UNLOADED
    assert p.pump() == [] and await request.granted == "cpu"

    # A load that needs more than the evictable models free chooses no victim at all.
    big = p.request_room(key("big"), {"cpu": 35 * MiB})  # 5 MiB free
    assert p.pump() == [] and not big.granted.done()
    # The young model passes the minimum residency: now it can go, but it is not enough.
    assert p.next_eligible() == 103.0
    clock.now = 104.0
    assert [c.key for c in p.candidates("cpu")] == [key("young")]
    assert p.pump() == []
    # The request in flight finishes: with the young one it frees enough.
    models[key("in-flight")].in_flight = 0
    evictions = p.pump()
    assert sorted(k.name for k, _ in evictions) == ["in-flight", "young"]
    assert all(k not in (key("pinned"), key("awaited"), key("loading")) for k, _ in evictions)


async def test_room_being_freed_for_a_request_is_kept_from_later_ones() -> None:
    models: dict[ModelKey, Model] = {}
    p = planner(models, Clock())
    resident(p, models, "x", 50)
    first = p.request_room(key("a"), {"cpu": 80 * MiB})  # 50 free: needs x gone
    second = p.request_room(key("b"), {"cpu": 40 * MiB})  # fits now, but not beside a
    small = p.request_room(key("c"), {"cpu": 20 * MiB})
    assert p.pump() == [(key("x"), "cpu")]
    models[key("x")].state = ModelState.EVICTING
    # a still lacks 30 MiB beyond x's 50: of the 50 free, 30 are kept for it, so b waits
    # and c takes 20 of what is left.
    assert not second.granted.done() and small.granted.result() == "cpu"
    p.ledger.release(key("x"))
    models[key("x")].state = ModelState.UNLOADED
    p.pump()
    assert await first.granted == "cpu" and not second.granted.done()
    assert p.ledger.used("cpu") == 100 * MiB


async def test_a_withdrawn_request_gives_back_room_granted_at_the_last_moment() -> None:
    p = planner({}, Clock())
    request = p.request_room(key("a"), {"cpu": 60 * MiB})
    p.pump()
    assert request.granted.done()
    p.broker.withdraw(request)  # its waiter was cancelled before it saw the grant
    assert p.ledger.used("cpu") == 0
    waiting = p.request_room(key("b"), {"cpu": 200 * MiB})
    p.pump()
    p.broker.abandon(waiting, RuntimeError("nobody waits"))
    with pytest.raises(RuntimeError, match="nobody waits"):
        await waiting.granted
    assert p.broker.pending == []
    cancelled = p.request_room(key("c"), {"cpu": 200 * MiB})
    p.broker.cancel_all()
    assert cancelled.granted.cancelled()
    await asyncio.sleep(0)


async def test_placement_prefers_the_device_of_the_warm_copy_then_the_tightest_fit() -> None:
    models: dict[ModelKey, Model] = {}
    p = Planner({"cuda:0": 100 * MiB, "cuda:1": 60 * MiB}, models, clock=Clock())
    need = {"cuda:0": 50 * MiB, "cuda:1": 50 * MiB}
    tight = p.request_room(key("a"), need)
    p.pump()
    assert tight.granted.result() == "cuda:1"  # 10 MiB left over beats 50
    p.ledger.release(key("a"))
    warm = p.request_room(key("a"), need, prefer="cuda:0")
    p.pump()
    assert warm.granted.result() == "cuda:0"
