"""Three `hub serve` replicas started at the same instant on an empty PostgreSQL database and
one MLflow server, each configured with the same models: all come up, each configured model
has exactly one version (in SQL and in MLflow), every replica lists all three, and a replica
killed with SIGKILL drops out of every list once its heartbeat expires.

The cluster is the package's shared one (conftest.py), started fresh for this package."""

from __future__ import annotations

import httpx
import pytest
from mlflow import MlflowClient
from sqlalchemy import text

from benchmarks.launch.cluster import Cluster, wait_for
from tests.hub.replicas.conftest import EXPIRE

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.serial]


def listed(base: str) -> set[str]:
    r = httpx.get(f"{base}/admin/replicas", timeout=10)
    assert r.status_code == 200, r.text
    return {replica["id"] for replica in r.json()["replicas"]}


def test_started_together_each_configured_model_has_one_version(cluster: Cluster) -> None:
    with cluster.engine.connect() as conn:
        versions = dict(conn.execute(text(
            "SELECT m.name, count(v.id) FROM hub_models m "
            "JOIN hub_model_versions v ON v.model_id = m.id "
            "WHERE m.name IN ('emb', 'rerank') GROUP BY m.name"
        )).all())  # fmt: skip
    assert versions == {"emb": 1, "rerank": 1}
    client = MlflowClient(tracking_uri=cluster.mlflow.url, registry_uri=cluster.mlflow.url)
    for name in ("emb", "rerank"):
        assert [mv.version for mv in client.search_model_versions(f"name = '{name}'")] == ["1"]
    assert client.get_registered_model("emb").aliases == {"production": "1"}


def test_replicas_list_each_other_and_a_killed_one_expires(cluster: Cluster) -> None:
    # Every replica lists all three, each at the address it serves on.
    ids = {}
    for base in cluster.bases:
        wait_for(lambda b=base: len(listed(b)) == 3, f"{base} never listed 3 replicas")
        body = httpx.get(f"{base}/admin/replicas", timeout=10).json()
        [me] = [rep for rep in body["replicas"] if rep["this"]]
        assert me["address"] == base
        ids[base] = me["id"]
    assert len(set(ids.values())) == 3

    # SIGKILL: no clean shutdown, the row stays, and expires from every list.
    victim, survivors = cluster.replicas[0], cluster.replicas[1:]
    victim.kill()
    for replica in survivors:
        wait_for(
            lambda b=replica.base: listed(b) == {ids[s.base] for s in survivors},
            f"the killed replica never expired from {replica.base}'s list",
            within=EXPIRE * 10,
        )
    with cluster.engine.connect() as conn:
        rows = set(conn.execute(text("SELECT id FROM hub_replicas")).scalars())
    assert ids[victim.base] in rows  # expired, not deleted: nobody shut it down

    # Restarted with the same id (same host and port), it takes its row over.
    victim.restart()
    for base in cluster.bases:
        wait_for(lambda b=base: len(listed(b)) == 3, f"{base} never listed the restarted one")


def test_a_clean_shutdown_deletes_the_row(cluster: Cluster) -> None:
    leaving = cluster.replicas[2]
    wait_for(lambda: len(listed(leaving.base)) == 3, "the cluster is not whole")
    with cluster.engine.connect() as conn:
        before = set(conn.execute(text("SELECT id FROM hub_replicas")).scalars())
    leaving.stop()
    with cluster.engine.connect() as conn:
        after = set(conn.execute(text("SELECT id FROM hub_replicas")).scalars())
    assert len(after) == len(before) - 1
    leaving.restart()
    wait_for(lambda: len(listed(cluster.bases[0])) == 3, "the restarted replica never came back")
