"""Model access: a key whose policy names models uses only those; anything else is the 404 of
a model that does not exist, on every route, and `/v1/models` lists only what it may use."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from backends.errors import CapacityError
from registry.db import Database
from registry.keys import ApiKeys
from tests.support.hubs import admin_register, auth_settings, running_app

Hub = tuple[FastAPI, httpx.AsyncClient, dict[str, dict[str, str]]]


@pytest.fixture
async def hub(
    tmp_path: Path,
    mlflow_template: Path,
    tiny_embedder_dir: Path,
    tiny_embedder_v2_dir: Path,
    tiny_reranker_dir: Path,
) -> AsyncIterator[Hub]:
    """`emb` v1 (production) and v2, reranker `rr`; keys by name: `app` (every model),
    `emb` (emb only), `emb2` (emb@2 only)."""
    settings, user_key = auth_settings(tmp_path / "hub", mlflow_template)
    keys = ApiKeys(Database(settings.database_url))
    emb_key, _ = keys.create("emb-team", "user", models=["emb"])
    emb2_key, _ = keys.create("emb2-team", "user", models=["emb@2"])
    headers = {
        name: {"Authorization": f"Bearer {key}"}
        for name, key in [("app", user_key), ("emb", emb_key), ("emb2", emb2_key)]
    }
    async with running_app(settings) as (app, client):
        await admin_register(client, "emb", "embedder", tiny_embedder_dir, aliases=["production"])
        await admin_register(client, "emb", "embedder", tiny_embedder_v2_dir)
        await admin_register(client, "rr", "reranker", tiny_reranker_dir)
        yield app, client, headers


def _rerank(model: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"query": "q", "documents": ["a", "b"]}
    return body if model is None else {"model": model, **body}


async def test_a_key_limited_to_one_model_gets_404_for_others_as_if_unknown(hub: Hub) -> None:
    app, client, keys = hub
    emb = keys["emb"]
    r = await client.post("/v1/embeddings", json={"model": "emb", "input": "hi"}, headers=emb)
    assert r.status_code == 200, r.text
    unknown = await client.post("/v1/rerank", json=_rerank("nobody"), headers=emb)
    assert unknown.status_code == 404
    expected = unknown.json()["error"]
    assert expected["code"] == "model_not_found" and "known models: emb)" in expected["message"]
    for path, body in [
        ("/v1/rerank", _rerank("rr")),
        ("/v2/rerank", _rerank("rr")),
        ("/v1/rerank", _rerank("rr@1")),
        ("/models/rr/rerank", _rerank()),
        ("/models/rr/versions/1/rerank", _rerank()),
    ]:
        r = await client.post(path, json=body, headers=emb)
        assert r.status_code == 404, (path, r.text)
        error = r.json()["error"]
        assert error == {**expected, "message": expected["message"].replace("nobody", "rr")}
    # The same request with a key that may use every model reaches the reranker.
    r = await client.post("/v1/rerank", json=_rerank("rr"), headers=keys["app"])
    assert r.status_code == 200, r.text
    # Nor does a refusal at the edge tell the limited key how loaded the model is.
    saturation = app.state.hub.saturation
    saturation._clock = lambda: 0.0
    saturation.mark("rr", 1, "reranker", CapacityError("rr is busy", saturated_s=10))
    r = await client.post("/v1/rerank", json=_rerank("rr"), headers=keys["app"])
    assert r.status_code == 503
    r = await client.post("/v1/rerank", json=_rerank("rr"), headers=emb)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_models_lists_only_what_the_key_may_use(hub: Hub) -> None:
    _, client, keys = hub
    r = await client.get("/v1/models", headers=keys["emb"])
    assert [m["id"] for m in r.json()["data"]] == ["emb"]
    r = await client.get("/v1/models", headers=keys["app"])
    assert sorted(m["id"] for m in r.json()["data"]) == ["emb", "rr"]
    assert (await client.get("/v1/models/rr", headers=keys["emb"])).status_code == 404
    assert (await client.get("/v1/models/rr@1", headers=keys["emb"])).status_code == 404
    assert (await client.get("/v1/models/emb@2", headers=keys["emb"])).status_code == 200


async def test_a_key_granted_one_version_uses_that_version_only(hub: Hub) -> None:
    _, client, keys = hub
    emb2 = keys["emb2"]
    r = await client.post("/v1/embeddings", json={"model": "emb@2", "input": "hi"}, headers=emb2)
    assert r.status_code == 200 and r.headers["x-hub-model-version"] == "2"
    # A bare name routes to production (v1), which this key may not use; nor v1 by number.
    for model in ("emb", "emb@1", "emb@production"):
        r = await client.post("/v1/embeddings", json={"model": model, "input": "hi"}, headers=emb2)
        assert r.status_code == 404, (model, r.text)
        assert "emb@2" in r.json()["error"]["message"]
    r = await client.post("/models/emb/versions/1/embed", json={"input": "hi"}, headers=emb2)
    assert r.status_code == 404
