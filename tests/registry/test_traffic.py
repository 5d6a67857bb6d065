"""Traffic policies and canaries in SQL: atomic replacement, validation that changes nothing,
splits across models of one kind, compare-and-set canary transitions."""

from __future__ import annotations

from pathlib import Path

import pytest

from registry.canaries import CanarySpec
from registry.errors import ConflictError, InvalidTrafficError
from registry.service import Registry
from registry.views import FaultView, ShadowView, SplitView


@pytest.fixture
def models(registry: Registry, tiny_embedder_dir: Path, tiny_reranker_dir: Path) -> Registry:
    for _ in range(3):
        registry.register("emb", "embedder", str(tiny_embedder_dir))
    registry.register("other", "embedder", str(tiny_embedder_dir))
    registry.register("rr", "reranker", str(tiny_reranker_dir))
    return registry


def split(*pairs: tuple[int, float], model: str = "emb") -> list[SplitView]:
    return [SplitView(model, version, weight) for version, weight in pairs]


def test_replace_is_whole_and_served_from_the_snapshot(models: Registry) -> None:
    r = models
    assert r.traffic.get("emb").splits == () and "emb" not in r.snapshot().traffic
    first = r.traffic.replace(
        "emb", split((1, 90), (2, 10)), shadow=ShadowView("emb", 3, 20),
        faults=[FaultView("emb", 2, 50.0, 10.0)], actor="alice",
    )  # fmt: skip
    assert [(s.version, s.weight) for s in first.splits] == [(1, 90.0), (2, 10.0)]
    assert first.shadow == ShadowView("emb", 3, 20.0) and first.updated_by == "alice"
    assert first.faults == (FaultView("emb", 2, 50.0, 10.0),)
    second = r.traffic.replace("emb", split((3, 100)), actor="bob")
    # Nothing of the first policy survives: not its versions, not its shadow or faults.
    assert [(s.version, s.weight) for s in second.splits] == [(3, 100.0)]
    assert second.shadow is None and second.faults == ()
    assert second.revision == first.revision + 1
    assert r.snapshot().traffic["emb"] == second
    cleared = r.traffic.clear("emb", actor="carol")
    assert cleared.splits == () and cleared.revision == second.revision + 1


BAD_SPLITS = [
    (split((1, 90), (2, 20)), "weights must sum to 100, not 90 + 20 = 110"),
    (split((1, 50), (7, 50)), "splits[1]: model emb has no version 7 (versions: 1, 2, 3)"),
    (split((1, 100), (1, 0)), "splits[1]: emb v1 is listed twice"),
    (split((1, 110), (2, -10)), "splits[0]: weight 110 is not within 0..100"),
    (split((1, 50)) + split((1, 50), model="rr"), "rr is a reranker but emb is an embedder"),
    (split((1, 50)) + split((1, 50), model="ghost"), "model 'ghost' is not registered"),
]


def test_bad_splits_are_refused_and_change_nothing(models: Registry) -> None:
    before = models.traffic.replace("emb", split((1, 100)), actor="a")
    for splits, message in BAD_SPLITS:
        with pytest.raises(InvalidTrafficError) as refused:
            models.traffic.replace("emb", splits, actor="b")
        assert message in str(refused.value)
        assert models.traffic.get("emb") == before


def test_bad_shadow_and_faults_are_refused(models: Registry) -> None:
    r = models
    with pytest.raises(InvalidTrafficError, match="shadow: percent 0 is not within"):
        r.traffic.replace("emb", split((1, 100)), shadow=ShadowView("emb", 2, 0), actor="a")
    with pytest.raises(InvalidTrafficError, match="shadow: model emb has no version 9"):
        r.traffic.replace("emb", split((1, 100)), shadow=ShadowView("emb", 9, 5), actor="a")
    with pytest.raises(InvalidTrafficError, match="faults\\[0\\]: error_percent 150"):
        r.traffic.replace("emb", split((1, 100)), faults=[FaultView("emb", 2, 150)], actor="a")
    assert r.traffic.get("emb").revision == 0


def test_a_split_may_name_another_model_of_the_same_kind(models: Registry) -> None:
    policy = models.traffic.replace(
        "emb", [SplitView("emb", 1, 50), SplitView("other", 1, 50)], actor="a"
    )
    assert [(s.model, s.version) for s in policy.splits] == [("emb", 1), ("other", 1)]


def test_canary_owns_the_split_and_transitions_are_compare_and_set(models: Registry) -> None:
    r = models
    spec = CanarySpec(steps=(10, 50, 100), interval_s=60, min_requests=5)
    canary = r.canaries.start("emb", 2, baseline=1, spec=spec, actor="alice", now=1000.0)
    assert (canary.state, canary.step_index, canary.weight) == ("running", 0, 10.0)
    assert [(s.version, s.weight) for s in r.traffic.get("emb").splits] == [(1, 90), (2, 10)]

    with pytest.raises(ConflictError, match="already running"):
        r.canaries.start("emb", 3, baseline=1, spec=spec, actor="bob", now=1000.0)
    with pytest.raises(ConflictError, match="owns the split"):
        r.traffic.replace("emb", split((1, 100)), actor="bob")

    # Two replicas decide to advance from the same step: exactly one wins.
    won = r.canaries.advance(canary, now=1060.0, check={"decision": "pass"}, actor="canary")
    lost = r.canaries.advance(canary, now=1061.0, check={"decision": "pass"}, actor="canary")
    assert won is not None and lost is None
    assert (won.step_index, won.step_started_at, won.weight) == (1, 1060.0, 50.0)
    assert [(s.version, s.weight) for s in r.traffic.get("emb").splits] == [(1, 50), (2, 50)]

    done = r.canaries.finish(
        won, state="rolled_back", reason="too many errors", splits=split((1, 100)), actor="c"
    )
    assert done is not None and (done.state, done.reason) == ("rolled_back", "too many errors")
    assert r.canaries.finish(won, state="aborted", reason="x", splits=[], actor="c") is None
    assert r.canaries.running() == [] and r.canaries.latest("emb") == done
    assert [(s.version, s.weight) for s in r.traffic.get("emb").splits] == [(1, 100)]
    # Finished: the split is free again, and a new canary may start from 100% baseline.
    again = r.canaries.start("emb", 3, baseline=1, spec=spec, actor="bob", now=2000.0)
    assert again.state == "running" and again.canary_version == 3


def test_canary_does_not_overwrite_an_experiment(models: Registry) -> None:
    models.traffic.replace("emb", split((1, 50), (3, 50)), actor="a")
    with pytest.raises(ConflictError, match="has a traffic split"):
        models.canaries.start("emb", 2, baseline=1, spec=CanarySpec(), actor="b", now=0.0)
    with pytest.raises(InvalidTrafficError, match="steps: must increase"):
        models.canaries.start(
            "emb", 2, baseline=1, spec=CanarySpec(steps=(50, 20)), actor="b", now=0.0
        )
