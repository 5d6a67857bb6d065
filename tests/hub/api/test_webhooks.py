"""MLflow's webhook: a signed delivery makes the hub follow an alias move at once; unsigned,
mis-signed, stale or replayed deliveries are refused."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from hub.app import create_app
from hub.webhooks import sign
from tests.hub.api.test_embeddings import register
from tests.hub.test_promotion import promote, served_version
from tests.support.hubs import make_settings

SECRET = "s3cret-for-tests"


@pytest.fixture
def slow_poll_client(tmp_path: Path, mlflow_template: Path):
    # Polling every 10 minutes: only the webhook can make the hub notice in this test.
    settings = make_settings(
        tmp_path / "hub", mlflow_template,
        registry={"poll_interval": 600, "webhook_secret": SECRET, "require_staging": False},
    )  # fmt: skip
    with TestClient(create_app(settings)) as client:
        yield client


def deliver(client: TestClient, body: dict, *, secret: str = SECRET, timestamp: int | None = None,
            delivery_id: str | None = None):  # fmt: skip
    raw = json.dumps(body).encode()
    ts = str(int(time.time()) if timestamp is None else timestamp)
    did = delivery_id or str(uuid.uuid4())
    headers = {
        "Content-Type": "application/json",
        "X-MLflow-Signature": sign(secret, did, ts, raw),
        "X-MLflow-Timestamp": ts,
        "X-MLflow-Delivery-Id": did,
    }
    return client.post("/webhooks/mlflow", content=raw, headers=headers)


def test_signed_delivery_makes_the_hub_follow_at_once(
    slow_poll_client: TestClient, tiny_embedder_dir: Path
) -> None:
    client = slow_poll_client
    hub = client.app.state.hub  # type: ignore[attr-defined]
    register(client, "emb", "embedder", tiny_embedder_dir)
    register(client, "emb", "embedder", tiny_embedder_dir)
    assert promote(client, 1, "production").status_code == 200
    assert served_version(client) == "1"
    hub.registry.mlflow.client.set_registered_model_alias("emb", "production", "2")
    assert served_version(client) == "1"  # not polled yet
    payload = {"entity": "model_version_alias", "action": "created",
               "data": {"name": "emb", "alias": "production", "version": "2"}}  # fmt: skip
    r = deliver(client, payload)
    assert r.status_code == 200, r.text
    assert served_version(client) == "2"


@pytest.mark.parametrize("problem", ["wrong-secret", "stale", "unsigned", "replayed"])
def test_bad_deliveries_are_refused(slow_poll_client: TestClient, problem: str) -> None:
    client = slow_poll_client
    body = {"entity": "model_version_alias", "action": "created", "data": {}}
    if problem == "wrong-secret":
        r = deliver(client, body, secret="guess")
    elif problem == "stale":
        r = deliver(client, body, timestamp=int(time.time()) - 3600)
    elif problem == "unsigned":
        r = client.post("/webhooks/mlflow", json=body)
    else:
        assert deliver(client, body, delivery_id="once").status_code == 200
        r = deliver(client, body, delivery_id="once")
    assert r.status_code == 401


def test_webhooks_off_without_a_secret(client: TestClient) -> None:
    assert client.post("/webhooks/mlflow", json={}).status_code == 404
