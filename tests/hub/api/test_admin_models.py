"""The admin surface of the manager: /admin/models and /admin/devices (with the host tier),
pin / unpin routes, 409 for a pin that cannot fit, and the CLI commands."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from hub.app import create_app
from hub.cli import app as cli
from tests.support.hubs import make_settings

MiB = 2**20


def register(client: TestClient, name: str, folder: Path) -> None:
    r = client.post(
        "/admin/registry/models", json={"name": name, "kind": "embedder", "source": str(folder)}
    )
    assert r.status_code == 201, r.text


@pytest.fixture
def small_client(tmp_path: Path, mlflow_template: Path) -> Iterator[TestClient]:
    """A hub whose CPU budget holds one tiny embedder (~32.1 MiB predicted), not two."""
    settings = make_settings(
        tmp_path / "hub",
        mlflow_template,
        devices=[{"name": "cpu", "memory_budget": "50MiB"}],
        host_cache_budget="64MiB",
        manager={"min_residency": 0, "load_timeout": "20s"},
    )
    with TestClient(create_app(settings)) as c:
        yield c


def test_pin_unpin_and_status_fields(client: TestClient, tiny_embedder_dir: Path) -> None:
    register(client, "emb", tiny_embedder_dir)
    r = client.post("/admin/models/emb/versions/1/pin")
    assert r.status_code == 200, r.text
    pinned = r.json()
    assert pinned["pinned"] and pinned["state"] == "loaded"
    assert pinned["keep_alive_expires_in_s"] is None and pinned["keep_alive_s"] == 300
    r = client.post("/admin/models/emb/versions/production/pin")
    assert r.status_code == 404 and "aliases: none" in r.json()["error"]["message"]
    unpinned = client.post("/admin/models/emb/versions/1/unpin").json()
    assert not unpinned["pinned"] and 0 < unpinned["keep_alive_expires_in_s"] <= 300
    assert client.post("/admin/models/emb/versions/1/unpin").status_code == 404
    [cpu] = client.get("/admin/devices").json()["devices"]
    assert cpu["models"] == 1 and cpu["pinned_bytes"] == 0 and cpu["used_bytes"] > 0


def test_keep_alive_zero_parks_the_model_in_the_host_tier(
    client: TestClient, tiny_embedder_dir: Path
) -> None:
    register(client, "emb", tiny_embedder_dir)
    body = {"model": "emb", "input": "hello", "keep_alive": 0}
    first = client.post("/v1/embeddings", json=body)
    assert first.status_code == 200
    [status] = client.get("/admin/models").json()
    assert status["state"] in ("evicting", "warm")
    devices = client.get("/admin/devices").json()
    if status["state"] == "warm":
        assert devices["host_tier"]["models"] == 1 and devices["host_tier"]["used_bytes"] > 0
    assert (
        devices["host_tier"]["budget_bytes"] == 2**30 and not devices["host_tier"]["pinned_memory"]
    )
    again = client.post("/v1/embeddings", json={**body, "keep_alive": "5m"})
    assert again.json()["data"] == first.json()["data"]
    [status] = client.get("/admin/models").json()
    assert status["state"] == "loaded" and status["warm_load_s"] is not None
    assert 0 < status["keep_alive_expires_in_s"] <= 300


def test_a_pin_that_cannot_fit_is_409_and_requests_get_503(
    small_client: TestClient, tiny_embedder_dir: Path, tiny_embedder_v2_dir: Path
) -> None:
    register(small_client, "a", tiny_embedder_dir)
    register(small_client, "b", tiny_embedder_v2_dir)
    assert small_client.post("/admin/models/a/versions/1/pin").status_code == 200
    r = small_client.post("/admin/models/b/versions/1/pin")
    assert r.status_code == 409
    message = r.json()["error"]["message"]
    assert "cannot pin b@1" in message and "a@1 (" in message and "pinned" in message
    r = small_client.post("/v1/embeddings", json={"model": "b", "input": "x"})
    assert r.status_code == 503 and r.headers["Retry-After"]
    assert "unpin a model or raise the budget" in r.json()["error"]["message"]
    # An admin unload lifts the pin; then b fits.
    assert small_client.post("/admin/models/a/versions/1/unload").json()["state"] == "unloaded"
    assert small_client.post("/v1/embeddings", json={"model": "b", "input": "x"}).status_code == 200


def test_cli_pin_unpin_status(
    client: TestClient, tiny_embedder_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    register(client, "emb", tiny_embedder_dir)

    def through_app(method: str, url: str, **kwargs: object) -> httpx.Response:
        return client.request(method, url, headers=kwargs.get("headers"))  # type: ignore[arg-type]

    monkeypatch.setattr(httpx, "request", through_app)
    runner = CliRunner()
    url = ["--url", "http://testserver"]
    result = runner.invoke(cli, ["pin", "emb", "1", *url])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["pinned"] is True
    status = json.loads(runner.invoke(cli, ["status", *url]).stdout)
    assert status["models"][0]["pinned"] and status["host_tier"]["budget_bytes"] == 2**30
    result = runner.invoke(cli, ["unpin", "emb", "1", *url])
    assert json.loads(result.stdout)["pinned"] is False
    result = runner.invoke(cli, ["unpin", "emb", "1", *url])
    assert result.exit_code == 1 and "is not pinned" in result.output


def test_a_configured_pin_follows_the_production_alias(
    tmp_path: Path, mlflow_template: Path, tiny_embedder_dir: Path, tiny_embedder_v2_dir: Path
) -> None:
    spec = {"name": "emb", "kind": "embedder", "source": str(tiny_embedder_dir),
            "aliases": ["production"], "pin": True}  # fmt: skip
    settings = make_settings(
        tmp_path / "hub",
        mlflow_template,
        models=[spec],
        registry={"poll_interval": 0.5, "require_staging": False},
    )

    def pins(client: TestClient) -> dict[int, bool]:
        return {m["version"]: m["pinned"] for m in client.get("/admin/models").json()}

    def until(client: TestClient, expected: dict[int, bool]) -> None:
        for _ in range(400):
            if pins(client) == expected:
                return
            time.sleep(0.05)
        raise AssertionError(f"pins never became {expected}: {pins(client)}")

    with TestClient(create_app(settings)) as client:
        until(client, {1: True})  # pinned at start
        register(client, "emb", tiny_embedder_v2_dir)
        r = client.post("/admin/registry/models/emb/versions/2/promote", json={"to": "production"})
        assert r.status_code == 200, r.text
        until(client, {1: False, 2: True})  # the pin moved with the serving version


def test_a_second_start_reuses_the_configured_models_it_registered(
    tmp_path: Path, mlflow_template: Path, tiny_embedder_dir: Path
) -> None:
    spec = {"name": "emb", "kind": "embedder", "source": str(tiny_embedder_dir),
            "aliases": ["production"]}  # fmt: skip
    settings = make_settings(tmp_path / "hub", mlflow_template, models=[spec])
    for _ in range(2):
        with TestClient(create_app(settings)) as client:
            versions = client.get("/admin/registry/models/emb/versions").json()
            assert [v["version"] for v in versions] == [1]
            assert versions[0]["aliases"] == ["production"]
            r = client.post("/v1/embeddings", json={"model": "emb", "input": "x"})
            assert r.status_code == 200 and r.headers["X-Hub-Model-Version"] == "1", r.text
