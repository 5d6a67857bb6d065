"""The words of a 503 for want of memory: whether waiting can help, who holds the memory and
why each holder stays."""

from __future__ import annotations

import pytest

from hub.manager.planning import ModelKey, NoRoom, Planner, needs_text, why_held
from hub.manager.residency import ModelState
from tests.hub.manager.planning.support import Clock, MiB, Model, key, resident

pytestmark = pytest.mark.pure


def test_a_model_larger_than_every_budget_is_too_large() -> None:
    p = Planner({"cpu": 100 * MiB, "cuda:0": 80 * MiB}, {})
    with pytest.raises(NoRoom) as e:
        p.check_feasible(key("huge"), {"cpu": 200 * MiB, "cuda:0": 90 * MiB})
    assert e.value.code == "too_large"
    assert e.value.message == (
        "huge@1 needs 200.0 MiB on cpu, 90.0 MiB on cuda:0, more than the whole budget of any "
        "device it may use (cpu 100.0 MiB, cuda:0 80.0 MiB); raise the budget or place it on "
        "a larger device"
    )
    p.check_feasible(key("fits"), {"cpu": 100 * MiB})  # the whole budget is enough


def test_pinned_models_that_leave_too_little_room_are_named() -> None:
    models: dict[ModelKey, Model] = {}
    p = Planner({"cpu": 100 * MiB}, models)
    resident(p, models, "a", 40, pinned=True)
    resident(p, models, "b", 30, pinned=True)
    resident(p, models, "c", 20, in_flight=3)  # busy, but not pinned: waiting can help
    p.check_feasible(key("d"), {"cpu": 30 * MiB})
    with pytest.raises(NoRoom) as e:
        p.check_feasible(key("d"), {"cpu": 31 * MiB})
    assert e.value.code == "pinned_full"
    assert e.value.message == (
        "d@1 needs 31.0 MiB but pinned models leave too little room (held by a@1 (40.0 MiB, "
        "pinned), b@1 (30.0 MiB, pinned)); unpin a model or raise the budget"
    )
    # A pinned model's own charge does not count against itself (a reload of a pin).
    p.check_feasible(key("a"), {"cpu": 70 * MiB})


async def test_a_waiting_load_is_told_what_holds_each_device() -> None:
    clock = Clock(now=100.0)
    models: dict[ModelKey, Model] = {}
    p = Planner({"cpu": 100 * MiB}, models, min_residency=10.0, clock=clock)
    resident(p, models, "busy", 40, in_flight=1)
    resident(p, models, "young", 25, loaded_at=97.5)
    resident(p, models, "coming", 20, state=ModelState.LOADING, loaded_at=None)
    resident(p, models, "old", 5, loaded_at=0.0)
    request = p.request_room(key("new"), {"cpu": 60 * MiB})
    p.pump()  # frees the idle 5 MiB model: not enough, so nothing is chosen
    assert p.explain(request) == (
        "; on cpu: needs 60.0 MiB, 10.0 MiB free of 100.0 MiB, held by busy@1 (40.0 MiB, "
        "1 request in flight), young@1 (25.0 MiB, loaded 2.5s ago, under the minimum "
        "residency), coming@1 (20.0 MiB, loading), old@1 (5.0 MiB, idle)"
    )
    assert p.explain(None) == ""


def test_why_held_and_needs_text() -> None:
    m = Model(key("m"), loaded_at=0.0)
    assert why_held(m, 10.0, 5.0) == "idle"
    m.waiting = 2
    assert why_held(m, 10.0, 5.0) == "2 waiting for it"
    m.in_flight = 3
    assert why_held(m, 10.0, 5.0) == "3 requests in flight"
    m.pinned = True
    assert why_held(m, 10.0, 5.0) == "pinned"
    evicting = Model(key("e"), state=ModelState.EVICTING)
    assert why_held(evicting, 10.0, 5.0) == "evicting"
    assert needs_text({"cpu": MiB, "cuda:0": MiB}) == "1.0 MiB"
    assert needs_text({"cpu": MiB, "cuda:0": 2 * MiB}) == "1.0 MiB on cpu, 2.0 MiB on cuda:0"
