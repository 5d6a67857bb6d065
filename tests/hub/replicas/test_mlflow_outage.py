"""MLflow killed under three replicas, then started again.

While MLflow is down every replica stays ready (the readiness body reports MLflow down) and
serves its resident models; a split change, a SQL-only write, reaches every replica within a
poll; a model in a replica's local cache loads, one that is not answers 503 and is not blamed
for it; a replica restarted meanwhile comes up and serves from its cache. Once MLflow is back
every replica reports it, and an alias moved in MLflow directly is followed without a restart.

Uses the package's shared cluster, with model names of its own (`dd-*`); it leaves MLflow
running, every replica up and no split on its models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from mlflow import MlflowClient

from benchmarks.launch.cluster import Cluster, Replica, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.serial]


def embed(replica: Replica, model: str) -> httpx.Response:
    """What each replica does on its own is the point here, so requests carry the signed hop
    headers a forwarding peer sets: served where they land, never placed elsewhere
    (test_placement.py covers placement)."""
    return replica.post_here("/v1/embeddings", {"model": model, "input": ["hello"]})


def served_by(replica: Replica, model: str) -> str | None:
    """The version that answered, None when it did not answer 200."""
    r = embed(replica, model)
    return r.headers["X-Hub-Model-Version"] if r.status_code == 200 else None


def mlflow_reported(replica: Replica) -> Any:
    """MLflow's state in the readiness body, with the drift check's ("up, running")."""
    r = replica.get("/health/ready", timeout=5)
    assert r.status_code == 200, r.text  # ready all along
    body = r.json()
    return body["dependencies"]["mlflow"]["up"], body["drift_check"]


def register(replica: Replica, name: str, source: Path, **extra: Any) -> None:
    body = {"name": name, "kind": "embedder", "source": str(source), **extra}
    r = replica.post("/admin/registry/models", json=body, timeout=120)
    assert r.status_code == 201, r.text


def test_an_mlflow_outage_degrades_only_what_needs_mlflow(
    cluster: Cluster, tiny_embedder_dir: Path, tiny_embedder_v2_dir: Path
) -> None:
    first, second, third = cluster.replicas
    register(first, "dd-emb", tiny_embedder_dir, aliases=["production"])
    register(first, "dd-emb", tiny_embedder_v2_dir)
    register(first, "dd-cold", tiny_embedder_dir, aliases=["production"])
    # Both versions served once by every replica: resident, and in each one's local cache.
    for replica in cluster.replicas:
        for model, version in (("dd-emb@1", "1"), ("dd-emb@2", "2")):
            wait_for(lambda r=replica, m=model, v=version: served_by(r, m) == v,
                     f"{replica.base} never served {model}")  # fmt: skip
    r = second.post("/admin/models/dd-emb/versions/1/unload")
    assert r.status_code == 200, r.text

    cluster.mlflow.kill()
    try:
        for replica in cluster.replicas:
            wait_for(lambda r=replica: mlflow_reported(r) == (False, "paused"),
                     f"{replica.base} never reported MLflow down")  # fmt: skip
            assert 'hub_dependency_up{dependency="mlflow"} 0.0' in replica.get("/metrics").text
            assert served_by(replica, "dd-emb") == "1"  # resident: production
        # Unloaded, but its verified copy is in the local cache: loads without MLflow.
        assert served_by(second, "dd-emb@1") == "1"
        # Never fetched by any replica: 503 now, and not held against the model.
        r = embed(third, "dd-cold")
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "mlflow_unavailable"
        assert "Retry-After" in r.headers

        # A split change is SQL only: it applies at once and reaches every replica.
        r = first.put("/admin/traffic/dd-emb", json={"splits": [{"version": 2, "weight": 100}]})
        assert r.status_code == 200, r.text
        for replica in cluster.replicas:
            wait_for(lambda r=replica: served_by(r, "dd-emb") == "2",
                     f"{replica.base} never followed the split", within=30)  # fmt: skip

        # A restarted replica starts without MLflow and serves from its cache.
        third.restart()
        assert mlflow_reported(third) == (False, "paused")
        assert served_by(third, "dd-emb") == "2"
    finally:
        if not cluster.mlflow.running:
            cluster.mlflow.start()

    # MLflow back: every replica says so and catches up without a restart.
    for replica in cluster.replicas:
        wait_for(lambda r=replica: mlflow_reported(r) == (True, "running"),
                 f"{replica.base} never reported MLflow back")  # fmt: skip
    assert served_by(third, "dd-cold") == "1"
    client = MlflowClient(tracking_uri=cluster.mlflow.url, registry_uri=cluster.mlflow.url)
    client.set_registered_model_alias("dd-emb", "production", "2")
    for replica in cluster.replicas:
        wait_for(lambda r=replica: served_by(r, "dd-emb@production") == "2",
                 f"{replica.base} never followed the alias moved in MLflow", within=30)  # fmt: skip
    r = first.delete("/admin/traffic/dd-emb")
    assert r.status_code == 200, r.text
