"""The one ingress, on a replica with a live peer (a recording HTTP server on loopback that
the replica's membership lists as holding version 2): a request is routed once, forwarded
with its body byte for byte when the peer holds the decided version, and otherwise served
here with that same version; a request a peer forwarded is served here with the version it
names; a body that does not parse, or names an unknown model, gets the route's own error;
an admin call naming the peer goes there. With one replica and a saturated model, the body
the ingress reads is the one the route validates: not JSON is the route's 400, too long its
413."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from backends.errors import CapacityError
from hub.api.ingress import classify
from hub.placement.forwarding import (
    FORWARDED_BY,
    ROUTE_HEADER,
    SIGNATURE_HEADER,
    HopSigner,
    hop_headers,
)
from registry.replicas import ReplicaView
from tests.support.hubs import make_settings, running_app
from tests.support.live import serving
from tests.support.traffic_hub import register

PEER = "peer-b"
SECRET = "shared-by-every-replica"


class RecordingPeer:
    """Answers every request 200 naming itself and the version `X-Hub-Route` named."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.seen.append({"path": scope["path"], "query": scope["query_string"],
                          "headers": headers, "body": body})  # fmt: skip
        version = headers.get(ROUTE_HEADER.lower(), "x@0").split(";")[0].split("@")[1]
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"x-hub-replica", PEER.encode()),
            (b"x-hub-model-version", version.encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": b'{"from": "peer"}'})


@pytest.fixture
async def peer() -> AsyncIterator[tuple[str, RecordingPeer]]:
    app = RecordingPeer()
    async with serving(app) as address:
        yield address, app


def _peer_row(address: str, held: list[dict[str, Any]]) -> ReplicaView:
    now = dt.datetime.now(dt.UTC)
    return ReplicaView(id=PEER, address=address, hub_version="test", started_at=now,
                       last_seen=now, seen_s_ago=0.0, models=held,
                       devices=[{"name": "cpu", "free_bytes": 2**30}], host_free_bytes=0,
                       queue_depth=0)  # fmt: skip


@pytest.fixture
async def placed(
    tmp_path: Path,
    mlflow_template: Path,
    tiny_embedder_dir: Path,
    tiny_embedder_v2_dir: Path,
    peer: tuple[str, RecordingPeer],
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient, RecordingPeer]]:
    """A hub with emb v1 (production) and v2 split 50/50, whose one live peer holds v2."""
    address, recorder = peer
    settings = make_settings(tmp_path / "hub", mlflow_template,
                             replica={"heartbeat_interval": 600, "expire_after": 1200,
                                      "hop_secret": SECRET})  # fmt: skip
    async with running_app(settings) as (app, client):
        assert await register(client, "emb", tiny_embedder_dir, aliases=["production"]) == 1
        assert await register(client, "emb", tiny_embedder_v2_dir) == 2
        split = {"splits": [{"version": 1, "weight": 50}, {"version": 2, "weight": 50}]}
        assert (await client.put("/admin/traffic/emb", json=split)).status_code == 200
        membership = app.state.hub.replicas

        async def no_beat() -> bool:  # the peer is the test's: no database read replaces it
            return False

        monkeypatch.setattr(membership, "beat", no_beat)
        held = [{"name": "emb", "version": 2, "state": "loaded", "bytes": 2**20}]
        membership.peers = [_peer_row(address, held)]
        membership.peers_as_of = time.monotonic()
        assert app.state.hub.placement.active
        yield app, client, recorder


async def test_a_request_is_routed_once_and_forwarded_unchanged_or_served_here(
    placed: tuple[FastAPI, httpx.AsyncClient, RecordingPeer],
) -> None:
    app, client, peer = placed
    here = app.state.hub.placement.id
    served: dict[str, set[str]] = {here: set(), PEER: set()}
    for i in range(24):
        # Half of them without a sticky key: the split picks a version at random each time.
        key = {"X-Hub-Route-Key": f"caller-{i}"} if i % 2 else {}
        body = f'{{"model":"emb",   "input": ["text {i}"]  }}'.encode()
        r = await client.post("/v1/embeddings", content=body, headers=key)
        assert r.status_code == 200, r.text
        replica, version = r.headers["x-hub-replica"], r.headers["x-hub-model-version"]
        served[replica].add(version)
        if replica == PEER:
            seen = peer.seen[-1]
            assert seen["body"] == body and seen["path"] == "/v1/embeddings"
            assert seen["headers"][FORWARDED_BY.lower()] == here
            assert seen["headers"][ROUTE_HEADER.lower()] == "emb@2;split"
            assert "t=" in seen["headers"][SIGNATURE_HEADER.lower()]
            assert seen["headers"].get("x-hub-route-key") == key.get("X-Hub-Route-Key")
        else:
            assert len(r.json()["data"]) == 1
    # The version placement decided is the version that answered: v2 only at the peer, v1
    # only here (routing again at the route would serve v2 here for about half of them).
    assert served == {here: {"1"}, PEER: {"2"}}


async def test_a_forwarded_request_is_served_here_with_the_version_it_names(
    placed: tuple[FastAPI, httpx.AsyncClient, RecordingPeer],
) -> None:
    app, client, peer = placed
    signer = HopSigner(SECRET)
    for path, body in [("/v1/embeddings", b'{"model": "emb", "input": "x"}'),
                       ("/models/emb/embed", b'{"input": "x"}')]:  # fmt: skip
        hop = hop_headers(signer, "POST", path, body, PEER, "emb@2;split")
        r = await client.post(path, content=body, headers=hop)
        assert r.status_code == 200, r.text
        assert r.headers["x-hub-model-version"] == "2"
        assert r.headers["x-hub-replica"] == app.state.hub.placement.id
    assert peer.seen == []  # held there, but a forwarded request is never forwarded again


async def test_a_body_that_does_not_route_gets_the_routes_own_error(
    placed: tuple[FastAPI, httpx.AsyncClient, RecordingPeer],
) -> None:
    app, client, peer = placed
    r = await client.post("/v1/embeddings", content=b'{"model": "emb", "input": ')
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = await client.post("/v1/embeddings", json={"model": "nobody", "input": "x"})
    assert r.status_code == 404, r.text
    assert r.headers["x-hub-replica"] == app.state.hub.placement.id
    assert peer.seen == []


async def test_an_admin_call_naming_a_replica_goes_there(
    placed: tuple[FastAPI, httpx.AsyncClient, RecordingPeer],
) -> None:
    app, client, peer = placed
    r = await client.post("/admin/models/emb/versions/2/pin", params={"replica": PEER})
    assert r.status_code == 200 and r.headers["x-hub-replica"] == PEER
    (seen,) = peer.seen
    assert (seen["path"], seen["query"]) == ("/admin/models/emb/versions/2/pin", b"replica=peer-b")
    assert seen["headers"][FORWARDED_BY.lower()] == app.state.hub.placement.id
    r = await client.post("/admin/models/emb/versions/2/pin", params={"replica": "nobody"})
    assert r.status_code == 404 and "GET /admin/replicas" in r.json()["error"]["message"]


async def test_a_body_read_for_a_saturated_model_is_the_one_the_route_validates(
    tmp_path: Path, mlflow_template: Path, tiny_embedder_dir: Path, tiny_reranker_dir: Path
) -> None:
    settings = make_settings(tmp_path / "hub", mlflow_template, max_request_body_bytes="64KiB")
    async with running_app(settings) as (app, client):
        await register(client, "emb", tiny_embedder_dir)
        await register(client, "busy", tiny_embedder_dir)
        saturation = app.state.hub.saturation
        saturation._clock = lambda: 0.0
        saturation.mark("busy", 1, "embedder", CapacityError("busy is busy", saturated_s=10))
        assert saturation  # bodies naming their model are read at the ingress now

        r = await client.post("/v1/embeddings", content=b'{"model": "emb", "input": ')
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"

        async def chunks() -> AsyncIterator[bytes]:
            yield b'{"model": "emb", "input": "'
            for _ in range(4):
                yield b"a" * 65536
            yield b'"}'

        r = await client.post("/v1/embeddings", content=chunks())
        assert r.status_code == 413 and "max_request_body_bytes" in r.json()["error"]["message"]
        # TEI's shape at /rerank is told apart by its body, read once for both looks.
        await register(client, "rr", tiny_reranker_dir, kind="reranker")
        r = await client.post("/rerank", json={"model": "rr", "query": "q", "texts": ["a", "b"]})
        assert r.status_code == 200 and len(r.json()) == 2
        r = await client.post("/v1/embeddings", content=json.dumps(
            {"model": "emb", "input": ["a", "b", "c"]}).encode())  # fmt: skip
        assert r.status_code == 200 and len(r.json()["data"]) == 3


def test_one_table_classifies_every_path_the_ingress_decides_for() -> None:
    def seen(path: str) -> tuple[str | None, str, bool, str | None] | None:
        found = classify(path)
        if found is None:
            return None
        endpoint, model = found
        return endpoint.serves, endpoint.label, endpoint.in_path, model

    assert seen("/v1/chat/completions") == ("llm", "chat", False, None)
    assert seen("/rerank") == ("reranker", "rerank", False, None)
    assert seen("/models/emb/embed") == ("embedder", "embeddings", True, "emb")
    assert seen("/models/emb/versions/3/embed") == ("embedder", "embeddings", True, "emb@3")
    assert seen("/models/tiny/generate") == ("llm", "generate", True, "tiny")
    assert seen("/models//embed") == ("embedder", "embeddings", True, None)
    assert seen("/admin/models/emb/versions/2/pin") == (None, "pin", True, "emb@2")
    for other in ("/v1/models", "/models/emb/chat", "/admin/models", "/health/live",
                  "/admin/registry/models/emb/versions/1/promote"):  # fmt: skip
        assert seen(other) is None


async def test_without_the_hop_secret_every_request_is_served_here(
    placed: tuple[FastAPI, httpx.AsyncClient, RecordingPeer],
) -> None:
    app, client, peer = placed
    placement = app.state.hub.placement
    placement.forwarder.signer = HopSigner(None)  # as a replica started without one
    assert not placement.active
    for i in range(8):
        r = await client.post("/v1/embeddings", json={"model": "emb", "input": [f"t {i}"]},
                              headers={"X-Hub-Route-Key": f"caller-{i}"})  # fmt: skip
        assert r.status_code == 200 and r.headers["x-hub-replica"] == placement.id
    assert peer.seen == []
