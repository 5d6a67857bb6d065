"""A running hub (in-process, lifespan run) with two versions of a tiny embedder: v1 is
production, v2 another set of weights. A fixture plugin: the conftest of each test folder
that uses it imports the fixtures (`two_versions`, `traffic_settings`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from hub.state import Hub
from tests.support.hubs import make_settings, running_app


async def register(client: httpx.AsyncClient, name: str, source: Path, **extra: Any) -> int:
    body = {"name": name, "kind": extra.pop("kind", "embedder"), "source": str(source), **extra}
    r = await client.post("/admin/registry/models", json=body)
    assert r.status_code == 201, r.text
    return int(r.json()["version"])


async def embed(
    client: httpx.AsyncClient, model: str = "emb", key: str | None = None, text: str = "hello"
) -> httpx.Response:
    headers = {"X-Hub-Route-Key": key} if key else {}
    return await client.post("/v1/embeddings", json={"model": model, "input": [text]},
                             headers=headers)  # fmt: skip


class TrafficHub:
    """The app, its Hub and an async client to it."""

    def __init__(self, app: FastAPI, client: httpx.AsyncClient) -> None:
        self.app = app
        self.client = client

    @property
    def hub(self) -> Hub:
        hub: Hub = self.app.state.hub
        return hub

    async def put(self, body: dict[str, Any], model: str = "emb") -> httpx.Response:
        return await self.client.put(f"/admin/traffic/{model}", json=body)

    async def readout(self, model: str = "emb") -> dict[str, Any]:
        r = await self.client.get(f"/admin/traffic/{model}/readout")
        assert r.status_code == 200, r.text
        doc: dict[str, Any] = r.json()
        return doc


def versions(readout: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["version"]: v for v in readout["versions"]}


@pytest.fixture
def traffic_settings() -> dict[str, Any]:
    """Overrides of the `traffic:` settings section; tests replace it to taste."""
    return {}


@pytest.fixture
async def two_versions(
    tmp_path: Path,
    mlflow_template: Path,
    tiny_embedder_dir: Path,
    tiny_embedder_v2_dir: Path,
    traffic_settings: dict[str, Any],
) -> AsyncIterator[TrafficHub]:
    settings = make_settings(tmp_path / "hub", mlflow_template, traffic=traffic_settings)
    async with running_app(settings) as (app, client):
        assert await register(client, "emb", tiny_embedder_dir, aliases=["production"]) == 1
        assert await register(client, "emb", tiny_embedder_v2_dir) == 2
        yield TrafficHub(app, client)
