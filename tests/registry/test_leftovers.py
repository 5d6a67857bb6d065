"""What interrupted registrations leave in MLflow (a run with artifacts and no version, a run
whose MLflow version has no SQL row, an empty registered model) is removed by the hub's
version check once older than the grace period, with an audit event where SQL knows the
model; a proper version and a young leftover are left alone."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from hub.catalog import Catalog
from hub.control import Control
from registry.drift import find_drift
from registry.leftovers import remove_leftovers
from registry.service import Registry


class Killed(Exception):
    """Stands for the process dying at this step of a registration."""


def _interrupted(
    r: Registry, name: str, folder: Path, step: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run the hub's own MLflow write for a new version of `name`, dying at `step` (a method
    of the MLflow client), as a `kill -9` there would leave it."""

    def die(*args: Any, **kwargs: Any) -> Any:
        raise Killed(step)

    with monkeypatch.context() as m:
        m.setattr(r.mlflow.client, step, die)
        with pytest.raises(Killed):
            r.mlflow.log_version(name, folder, tags={"hub.kind": "embedder"})


def _active_runs(r: Registry) -> list[Any]:
    return list(r.mlflow.client.search_runs([r.mlflow._experiment()]))


def test_interrupted_registrations_are_cleaned_up_by_the_version_check(
    registry: Registry, tiny_embedder_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = registry
    r.register("emb", "embedder", str(tiny_embedder_dir))
    # Killed after uploading the files, before the registered model / version was made.
    _interrupted(r, "emb", tiny_embedder_dir, "create_registered_model", monkeypatch)
    # Killed after MLflow's version, before the SQL row.
    r.mlflow.log_version("emb", tiny_embedder_dir, tags={})
    # A new model, killed after its registered model was created, before its first version.
    _interrupted(r, "ghost", tiny_embedder_dir, "create_model_version", monkeypatch)
    runs = _active_runs(r)
    assert len(runs) == 4
    leftover_dirs = [
        Path(urlparse(run.info.artifact_uri).path)
        for run in runs
        if run.info.artifact_uri.rstrip("/") + "/model" != r.get_version("emb", 1).artifact_uri
    ]
    assert len(leftover_dirs) == 3 and all(d.exists() for d in leftover_dirs)

    # Younger than the grace period: a registration that may still be in progress.
    assert remove_leftovers(r.db, r.mlflow, grace=3600) == []

    control = Control(r, Catalog(r), leftover_grace=0)
    drift = asyncio.run(control.find_drift(versions=True))
    assert sorted((d.model, d.repaired) for d in drift) == [
        ("emb", True), ("emb", True), ("ghost", True), ("ghost", True)
    ]  # fmt: skip
    details = " | ".join(d.detail for d in drift)
    assert "and its MLflow version(s) [2]" in details
    assert "registered model with no versions" in details

    # What is left: the one proper version, its files, no drift.
    assert r.mlflow.version_numbers("emb") == {1}
    assert "ghost" not in r.mlflow.all_aliases()
    assert len(_active_runs(r)) == 1
    assert not any(d.exists() for d in leftover_dirs)
    assert r.get_version("emb", 1).status == "registered"
    assert find_drift(r.db, r.mlflow, r.aliases, versions=True, repair=True) == []
    cleanups = [e for e in r.events("emb") if e.action == "cleanup"]
    assert len(cleanups) == 2 and all(e.actor == "hub:cleanup" for e in cleanups)
    # Nothing more to do on the next check.
    assert asyncio.run(control.find_drift(versions=True)) == []
