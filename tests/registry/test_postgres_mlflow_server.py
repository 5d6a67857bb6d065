"""The promotion flow as docker-compose runs it: PostgreSQL metadata, an MLflow server (whose
own store is PostgreSQL too), a hub process; alias moves pushed by MLflow's webhook."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import yaml
from mlflow import MlflowClient

from benchmarks.launch.process import free_port, hub_process, mlflow_server
from tests.support.postgres import throwaway_postgres

SECRET = "compose-webhook-secret"


def embed_version(base: str) -> str:
    r = httpx.post(f"{base}/v1/embeddings", json={"model": "emb", "input": "x"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["X-Hub-Model-Version"]


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.apart
def test_flow_on_postgres_and_an_mlflow_server(
    tmp_path: Path, tiny_embedder_dir: Path, tiny_embedder_v2_dir: Path
) -> None:
    with (
        throwaway_postgres(("hub", "mlflow")) as urls,
        mlflow_server(urls["mlflow"], tmp_path) as ml,
    ):
        port = free_port()
        config = tmp_path / "hub.yaml"
        config.write_text(yaml.safe_dump({
            "database_url": urls["hub"],
            "mlflow_tracking_uri": ml,
            "cache_dir": str(tmp_path / "cache"),
            # Polling every 10 minutes: following MLflow below can only be the webhook's doing.
            "registry": {"poll_interval": 600, "webhook_secret": SECRET,
                         "webhook_url": f"http://127.0.0.1:{port}/webhooks/mlflow"},
        }))  # fmt: skip
        with hub_process(config, tmp_path, port=port) as (base, _):
            admin = httpx.Client(base_url=base, timeout=120)
            for folder in (tiny_embedder_dir, tiny_embedder_v2_dir):
                r = admin.post("/admin/registry/models", json={
                    "name": "emb", "kind": "embedder", "source": str(folder)})  # fmt: skip
                assert r.status_code == 201, r.text
            for version, to in (
                (1, "staging"),
                (1, "production"),
                (2, "staging"),
                (2, "production"),
            ):
                r = admin.post(
                    f"/admin/registry/models/emb/versions/{version}/promote", json={"to": to}
                )
                assert r.status_code == 200, r.text
            assert embed_version(base) == "2"
            assert admin.post("/admin/registry/models/emb/rollback").status_code == 200
            assert embed_version(base) == "1"

            client = MlflowClient(tracking_uri=ml, registry_uri=ml)
            aliases = {a: int(v) for a, v in client.get_registered_model("emb").aliases.items()}
            assert aliases == {"production": 1, "staging": 2}

            # Moved outside the hub; MLflow's webhook makes the hub follow without polling.
            client.set_registered_model_alias("emb", "production", "2")
            deadline = time.monotonic() + 60  # delivery is asynchronous inside MLflow
            while embed_version(base) != "2":
                assert time.monotonic() < deadline, "the webhook never made the hub follow"
                time.sleep(0.2)
            events = admin.get("/admin/registry/events", params={"model": "emb"}).json()
            assert [e["action"] for e in reversed(events)] == [
                "promote",
                "promote",
                "promote",
                "promote",
                "rollback",
                "sync",
            ]
