"""Three `hub serve` replicas started at the same instant on an empty PostgreSQL database and
one MLflow server, each configured with the same models: all come up, each configured model
has exactly one version (in SQL and in MLflow), every replica lists all three, and a replica
killed with SIGKILL drops out of every list once its heartbeat expires.

One module, one PostgreSQL cluster, one MLflow server and three hubs: the processes are
shared by the assertions below rather than started per test."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml
from mlflow import MlflowClient
from sqlalchemy import create_engine, text

from tests.support.postgres import throwaway_postgres
from tests.support.process import hub_processes, mlflow_server

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

HEARTBEAT, EXPIRE = 0.5, 2.0


def listed(base: str) -> set[str]:
    r = httpx.get(f"{base}/admin/replicas", timeout=10)
    assert r.status_code == 200, r.text
    return {replica["id"] for replica in r.json()["replicas"]}


def wait_for(condition: Callable[[], bool], what: str, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_three_replicas_start_together_and_share_membership(
    tmp_path: Path, tiny_embedder_dir: Path, tiny_reranker_dir: Path
) -> None:
    with (
        throwaway_postgres(("hub", "mlflow")) as urls,
        mlflow_server(urls["mlflow"], tmp_path) as ml,
    ):
        config = tmp_path / "hub.yaml"
        config.write_text(yaml.safe_dump({
            "database_url": urls["hub"],
            "mlflow_tracking_uri": ml,
            "cache_dir": ".hub/cache",  # relative: each replica in its own folder, as pods
            "devices": [{"name": "cpu", "memory_budget": "1GiB"}],
            "models": [
                {"name": "emb", "kind": "embedder", "source": str(tiny_embedder_dir),
                 "aliases": ["production"]},
                {"name": "rerank", "kind": "reranker", "source": str(tiny_reranker_dir)},
            ],
            "replica": {"heartbeat_interval": HEARTBEAT, "expire_after": EXPIRE},
        }))  # fmt: skip
        folders = [tmp_path / f"replica-{i}" for i in range(3)]
        for folder in folders:
            folder.mkdir()

        with hub_processes(config, folders) as replicas:
            bases = [base for base, _ in replicas]

            # One version per configured model, in the hub's tables and in MLflow.
            engine = create_engine(urls["hub"])
            with engine.connect() as conn:
                versions = dict(conn.execute(text(
                    "SELECT m.name, count(v.id) FROM hub_models m "
                    "JOIN hub_model_versions v ON v.model_id = m.id GROUP BY m.name"
                )).all())  # fmt: skip
            assert versions == {"emb": 1, "rerank": 1}
            client = MlflowClient(tracking_uri=ml, registry_uri=ml)
            for name in ("emb", "rerank"):
                assert [mv.version for mv in client.search_model_versions(f"name = '{name}'")] == [
                    "1"
                ]
            assert client.get_registered_model("emb").aliases == {"production": "1"}
            # Every replica lists all three, each at the address it serves on.
            ids = {}
            for base in bases:
                wait_for(lambda b=base: len(listed(b)) == 3, f"{base} never listed 3 replicas")
                body = httpx.get(f"{base}/admin/replicas", timeout=10).json()
                [me] = [rep for rep in body["replicas"] if rep["this"]]
                assert me["address"] == base
                ids[base] = me["id"]
            assert len(set(ids.values())) == 3

            # SIGKILL: no clean shutdown, the row stays, and expires from every list.
            victim_base, victim = replicas[0]
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(timeout=30)
            survivors = bases[1:]
            for base in survivors:
                wait_for(
                    lambda b=base: listed(b) == {ids[s] for s in survivors},
                    f"the killed replica never expired from {base}'s list",
                    within=EXPIRE * 10,
                )
            with engine.connect() as conn:
                rows = set(conn.execute(text("SELECT id FROM hub_replicas")).scalars())
            assert ids[victim_base] in rows  # expired, not deleted: nobody shut it down

        # The survivors shut down cleanly and deleted their rows; the dead one's remains.
        with engine.connect() as conn:
            rows = set(conn.execute(text("SELECT id FROM hub_replicas")).scalars())
        assert rows == {ids[victim_base]}
        engine.dispose()
