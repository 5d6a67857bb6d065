"""An adapter's dependency on its base in the pure planner: a base is offered for eviction
only with all its adapters, after them, and a busy or pinned adapter keeps it."""

from __future__ import annotations

import pytest

from hub.manager.planning import ModelKey, Planner
from hub.manager.planning.dependents import riders_first
from hub.manager.planning.eviction import Candidate, LargestFirst
from tests.hub.manager.planning.support import MiB, Model, key, resident

pytestmark = pytest.mark.pure


def setup(**adapter: object) -> tuple[Planner, dict[ModelKey, Model]]:
    models: dict[ModelKey, Model] = {}
    planner = Planner({"cpu": 100 * MiB}, models, policy=LargestFirst())
    resident(planner, models, "base", 60)
    resident(planner, models, "a1", 5, base=key("base"), **adapter)
    resident(planner, models, "a2", 5, base=key("base"))
    return planner, models


def test_the_base_is_offered_after_its_adapters() -> None:
    planner, _ = setup()
    ordered = riders_first(planner.policy.order(planner.candidates("cpu")))
    assert [c.key.name for c in ordered] == ["a1", "a2", "base"]  # largest-first, but riders


@pytest.mark.parametrize("busy", [{"in_flight": 1}, {"pinned": True}])
def test_a_busy_or_pinned_adapter_keeps_its_base(busy: dict[str, object]) -> None:
    planner, _ = setup(**busy)
    assert [c.key.name for c in planner.candidates("cpu")] == ["a2"]
    assert planner.adapters_on(key("base")) == [key("a1"), key("a2")]


def test_riders_first_keeps_everything_else_in_place() -> None:
    def cand(name: str, base: str | None = None) -> Candidate:
        return Candidate(key(name), "cpu", MiB, 0.0, 1.0, 1, key(base) if base else None)

    order = [cand("b"), cand("x"), cand("a1", "b"), cand("y"), cand("a2", "b")]
    assert [c.key.name for c in riders_first(order)] == ["x", "a1", "y", "a2", "b"]
