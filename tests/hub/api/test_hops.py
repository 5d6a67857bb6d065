"""Hop headers from outside: a caller with a user key who sends `X-Hub-Forwarded-By` and
`X-Hub-Route` (unsigned, signed with another secret, or signed too long ago) gets what the
same request without them gets: the model and version routing picks, 404 for an unknown
model, 400 for a model of another kind, and nothing in the model's readout (no version of
another model, no routed count) that a plain request would not put there. The same headers
signed with the replicas' secret are obeyed. Every admin route answers 401 without a key,
whatever its query names (`?replica=`), before looking anything up."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from hub.app import create_app
from hub.placement.forwarding import FORWARDED_BY, ROUTE_HEADER, HopSigner, hop_headers
from hub.settings import HubSettings, ReplicaSettings
from tests.support.hubs import ADMIN, admin_register, auth_settings, running_app
from tests.support.traffic_hub import versions

SECRET = "shared-by-every-replica"


@pytest.fixture
async def hub(
    tmp_path: Path,
    mlflow_template: Path,
    tiny_embedder_dir: Path,
    tiny_embedder_v2_dir: Path,
    tiny_reranker_dir: Path,
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient, dict[str, str]]]:
    """Keys required, the replicas' secret set: `emb` v1 (production) and v2, reranker `rr`;
    yields the app, a client and a user key's header."""
    settings, user_key = auth_settings(tmp_path / "hub", mlflow_template)
    settings = settings.model_copy(update={"replica": ReplicaSettings(hop_secret=SECRET)})
    async with running_app(settings) as (app, client):
        await admin_register(client, "emb", "embedder", tiny_embedder_dir, aliases=["production"])
        await admin_register(client, "emb", "embedder", tiny_embedder_v2_dir)
        await admin_register(client, "rr", "reranker", tiny_reranker_dir)
        yield app, client, {"Authorization": f"Bearer {user_key}"}


def _forged(kind: str, path: str, body: bytes, route: str) -> dict[str, str]:
    """Hop headers for `route`: `unsigned`, signed with a `foreign` secret, or `stale`
    (signed with the right secret ten minutes ago)."""
    if kind == "unsigned":
        return {FORWARDED_BY: "p", ROUTE_HEADER: route}
    signer = {
        "foreign": HopSigner("not-the-replicas-secret"),
        "stale": HopSigner(SECRET, clock=lambda: time.time() - 600),
    }[kind]
    return hop_headers(signer, "POST", path, body, "p", route)


def _body(**fields: Any) -> bytes:
    return json.dumps({"input": ["hello"], **fields}).encode()


async def _readout(client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    r = await client.get("/admin/traffic/emb/readout", headers=ADMIN)
    assert r.status_code == 200, r.text
    return versions(r.json())


@pytest.mark.parametrize("kind", ["unsigned", "foreign", "stale"])
async def test_forged_hop_headers_from_a_user_key_change_nothing(
    hub: tuple[FastAPI, httpx.AsyncClient, dict[str, str]], kind: str
) -> None:
    app, client, user = hub

    async def post(body: bytes, route: str, path: str = "/v1/embeddings") -> httpx.Response:
        headers = {**user, **_forged(kind, path, body, route)}
        return await client.post(path, content=body, headers=headers)

    # An unknown model stays unknown, whatever version the route header names.
    r = await post(_body(model="nobody"), "emb@1;via=nobody")
    assert r.status_code == 404, r.text
    # A reranker asked for embeddings is still the wrong kind.
    plain = await client.post("/v1/embeddings", content=_body(model="rr"), headers=user)
    r = await post(_body(model="rr"), "emb@1;via=rr")
    assert r.status_code == plain.status_code == 400, r.text
    # The version routing picks (production, v1) answers, not the one the header names.
    for path, body in [("/v1/embeddings", _body(model="emb")), ("/models/emb/embed", _body())]:
        r = await post(body, "emb@2;pinned", path)
        assert r.status_code == 200, r.text
        assert r.headers["x-hub-model-version"] == "1"
    # Another model's version does not enter emb's readout, nor a forged `;split` its
    # routed counts.
    r = await post(_body(model="emb"), "rr@1;via=emb;split")
    assert r.status_code == 200 and r.headers["x-hub-model-version"] == "1"
    r = await post(_body(model="emb@1"), "emb@1;split")
    assert r.status_code == 200 and r.headers["x-hub-model-version"] == "1"
    readout = await _readout(client)
    assert set(readout) == {"1"}
    assert readout["1"]["requests"] == 4 and readout["1"]["routed"] == 0
    assert (
        app.state.hub.placement.metrics.hops_refused.labels(
            {"foreign": "bad_signature"}.get(kind, kind)
        )._value.get()
        == 6
    )


async def test_hop_headers_signed_with_the_replicas_secret_are_obeyed(
    hub: tuple[FastAPI, httpx.AsyncClient, dict[str, str]],
) -> None:
    _, client, user = hub
    signer = HopSigner(SECRET)

    async def post(body: bytes, route: str, signed_body: bytes | None = None) -> httpx.Response:
        hop = hop_headers(signer, "POST", "/v1/embeddings", signed_body or body, "peer", route)
        return await client.post("/v1/embeddings", content=body, headers={**user, **hop})

    r = await post(_body(model="emb"), "emb@2;split")
    assert r.status_code == 200 and r.headers["x-hub-model-version"] == "2"
    # A public name the peer's split sent to another version is served by that version.
    r = await post(_body(model="pub"), "emb@2;via=pub")
    assert r.status_code == 200 and r.headers["x-hub-model-version"] == "emb@2"
    # The signature covers the body: the same headers over another body are a client's.
    r = await post(_body(model="emb"), "emb@2;split", signed_body=_body(model="emb", user="x"))
    assert r.status_code == 200 and r.headers["x-hub-model-version"] == "1"
    # The peer's caller is still authenticated.
    hop = hop_headers(signer, "POST", "/v1/embeddings", _body(model="emb"), "peer", "emb@2")
    r = await client.post("/v1/embeddings", content=_body(model="emb"), headers=hop)
    assert r.status_code == 401


async def test_without_a_secret_no_hop_is_obeyed(
    tmp_path: Path, mlflow_template: Path, tiny_embedder_dir: Path, tiny_embedder_v2_dir: Path
) -> None:
    settings, user_key = auth_settings(tmp_path / "hub", mlflow_template)
    assert settings.replica.hop_secret is None and settings.replica.placement
    user = {"Authorization": f"Bearer {user_key}"}
    async with running_app(settings) as (_, client):
        await admin_register(client, "emb", "embedder", tiny_embedder_dir, aliases=["production"])
        await admin_register(client, "emb", "embedder", tiny_embedder_v2_dir)
        body = _body(model="emb")
        hop = hop_headers(HopSigner(SECRET), "POST", "/v1/embeddings", body, "peer", "emb@2")
        r = await client.post("/v1/embeddings", content=body, headers={**user, **hop})
        assert r.status_code == 200 and r.headers["x-hub-model-version"] == "1"


def _admin_calls(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every admin route the app documents, its path parameters filled
    with a name that exists nowhere."""
    calls = []
    for template, operations in app.openapi()["paths"].items():
        if template.startswith("/admin"):
            path = re.sub(r"\{[^}]+\}", "x", template)
            calls += [(method.upper(), path) for method in operations]
    return calls


async def test_every_admin_route_answers_401_without_a_key_whatever_its_query(
    tmp_path: Path, mlflow_template: Path
) -> None:
    settings, user_key = auth_settings(tmp_path / "hub", mlflow_template)
    calls = _admin_calls(create_app(HubSettings()))
    assert ("POST", "/admin/models/x/versions/x/pin") in calls and len(calls) >= 20
    async with running_app(settings) as (_, client):
        for method, path in calls:
            for params in ({"replica": "x"}, {}, {"replica": "x", "model": "x", "version": "1"}):
                r = await client.request(method, path, params=params, json={})
                assert r.status_code == 401, (method, path, params, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"
            r = await client.request(method, path, params={"replica": "x"}, json={},
                                     headers={"Authorization": f"Bearer {user_key}"})  # fmt: skip
            assert r.status_code == 403, (method, path, r.text)
