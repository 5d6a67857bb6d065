"""Alias moves: audited, compare-and-set, serialised; rollback history; drift repair."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from registry.drift import find_drift
from registry.errors import ConflictError, NotFoundError
from registry.service import Registry


@pytest.fixture
def three_versions(registry: Registry, tiny_embedder_dir: Path) -> Registry:
    for _ in range(3):
        registry.register("emb", "embedder", str(tiny_embedder_dir))
    return registry


def test_move_records_from_and_to(three_versions: Registry) -> None:
    r = three_versions
    r.aliases.move("emb", "production", 1, actor="alice", reason="first")
    event = r.aliases.move("emb", "production", 2, actor="bob", reason="better")
    assert (event.action, event.from_version, event.version, event.actor) == ("move", 1, 2, "bob")
    assert r.mlflow.aliases("emb")["production"] == 2
    assert r.aliases.recorded("emb") == {"production": 2}
    removed = r.aliases.move("emb", "production", None, actor="carol")
    assert removed.action == "remove" and "production" not in r.mlflow.aliases("emb")


def test_stale_expectation_is_refused_and_changes_nothing(three_versions: Registry) -> None:
    r = three_versions
    r.aliases.move("emb", "production", 1, actor="a")
    r.aliases.move("emb", "production", 2, actor="b")
    with pytest.raises(
        ConflictError, match="moved to v2 while this change was prepared against v1"
    ):
        r.aliases.move("emb", "production", 3, actor="c", expected=1)
    assert r.mlflow.aliases("emb")["production"] == 2
    assert [e.version for e in r.aliases.history("emb", "production")] == [1, 2]


def test_unknown_version_is_refused(three_versions: Registry) -> None:
    with pytest.raises(NotFoundError, match="no version 9"):
        three_versions.aliases.move("emb", "production", 9, actor="a")
    assert three_versions.mlflow.aliases("emb") == {}


def test_concurrent_moves_from_two_replicas_serialise(three_versions: Registry) -> None:
    """Two threads (as two hub replicas would) both move production expecting v1: exactly one
    wins, the other is told the alias moved under it."""
    r = three_versions
    r.aliases.move("emb", "production", 1, actor="setup")
    barrier = threading.Barrier(2)
    outcomes: dict[int, str] = {}

    def attempt(version: int) -> None:
        barrier.wait()
        try:
            r.aliases.move("emb", "production", version, actor=f"r{version}", expected=1)
            outcomes[version] = "moved"
        except ConflictError:
            outcomes[version] = "conflict"

    threads = [threading.Thread(target=attempt, args=(v,)) for v in (2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes.values()) == ["conflict", "moved"]
    winner = next(v for v, o in outcomes.items() if o == "moved")
    assert r.mlflow.aliases("emb")["production"] == winner
    assert [e.version for e in r.aliases.history("emb", "production")] == [1, winner]


def test_rollback_walks_back_through_promotions(three_versions: Registry) -> None:
    r = three_versions
    for v in (1, 2, 3):
        r.aliases.move("emb", "production", v, actor="ci")
    assert r.aliases.rollback_target("emb") == (3, 2)
    r.aliases.move("emb", "production", 2, actor="ops", action="rollback", expected=3)
    assert r.aliases.rollback_target("emb") == (2, 1)
    r.aliases.move("emb", "production", 1, actor="ops", action="rollback", expected=2)
    with pytest.raises(ConflictError, match="no earlier production version"):
        r.aliases.rollback_target("emb")


def test_passed_stage_needs_a_passing_gate(three_versions: Registry) -> None:
    r = three_versions
    r.aliases.move("emb", "staging", 1, actor="ci", validation={"passed": True})
    r.aliases.move("emb", "staging", 2, actor="ci")  # moved without a gate result
    assert r.aliases.passed_stage("emb", 1)
    assert not r.aliases.passed_stage("emb", 2)
    assert not r.aliases.passed_stage("emb", 3)


def test_alias_moved_in_mlflow_is_recorded_as_drift(three_versions: Registry) -> None:
    r = three_versions
    r.aliases.move("emb", "production", 1, actor="ci")
    # Someone moves the alias with MLflow's own client, bypassing the hub.
    r.mlflow.client.set_registered_model_alias("emb", "production", "3")
    drift = find_drift(r.db, r.mlflow, r.aliases, versions=True, repair=True)
    assert [(d.kind, d.repaired) for d in drift] == [("alias", True)]
    assert "MLflow has v3, the audit log has v1" in drift[0].detail
    latest = r.events("emb")[0]
    assert (latest.action, latest.actor, latest.from_version, latest.version) == (
        "sync", "reconciler", 1, 3,
    )  # fmt: skip
    assert find_drift(r.db, r.mlflow, r.aliases, versions=True, repair=True) == []


def test_version_only_in_mlflow_is_reported(
    three_versions: Registry, tiny_embedder_dir: Path
) -> None:
    r = three_versions
    r.mlflow.log_version("emb", tiny_embedder_dir, tags={})  # an MLflow write with no SQL row
    drift = find_drift(r.db, r.mlflow, r.aliases, versions=True, repair=True)
    assert [(d.kind, d.detail, d.repaired) for d in drift] == [
        ("version", "v4 exists in MLflow only", False)
    ]
