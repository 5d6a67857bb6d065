"""The HTTP edge refuses a model's requests at once while its queue drains: after a refusal
for queue time, requests naming that model (in the body or the path) get the same 503 and
Retry-After without reaching the model's queue, until the queue is estimated back under its
bound; a version named with `@`, another model, and anything after the window go the whole
way, with their bodies intact. The board's clock is the test's: no timing in assertions."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.hub.api.test_embeddings import ParkedForward, until_queued

if TYPE_CHECKING:
    import httpx
    from fastapi import FastAPI

EDGE = "refused at the HTTP edge"


async def _register(client: httpx.AsyncClient, name: str, folder: Path, **config: Any) -> None:
    body = {"name": name, "kind": "embedder", "source": str(folder),
            "config": {"max_batch_size": 1, "forward_workers": 1, **config}}  # fmt: skip
    assert (await client.post("/admin/registry/models", json=body)).status_code == 201


async def test_a_saturated_model_is_refused_at_the_edge_until_its_queue_drains(
    app_client: tuple[FastAPI, httpx.AsyncClient], tiny_embedder_dir: Path
) -> None:
    app, client = app_client
    await _register(client, "emb", tiny_embedder_dir, max_queue_time_ms=25)
    await _register(client, "other", tiny_embedder_dir)
    hub = app.state.hub
    now = [0.0]
    hub.saturation._clock = lambda: now[0]
    async with hub.manager.acquire("emb", 1) as backend:
        parked = ParkedForward(backend)
        try:
            first = asyncio.create_task(client.post("/models/emb/embed", json={"input": "a"}))
            await asyncio.to_thread(parked.entered.wait, 30)
            batcher = backend._batcher
            batcher.admission.observe(1, 0.010)  # the first measured pass: 10 ms an input
            ((_, started),) = batcher.work.running
            batcher.work.clock = lambda: started + 0.010
            # 0, 10, 20 ms of queue fit 25 ms; the fourth request would wait 30 ms: refused
            # by the queue, 5 ms over its bound.
            queued = [
                asyncio.create_task(
                    client.post("/v1/embeddings", json={"model": "emb", "input": f"q{i}"})
                )
                for i in range(3)
            ]
            await until_queued(backend, 3)
            refused = await client.post("/v1/embeddings", json={"model": "emb", "input": "r"})
            assert refused.status_code == 503 and EDGE not in refused.text
            checks = []
            admit = batcher.work.admit
            batcher.work.admit = lambda size: checks.append(size) or admit(size)

            # Within the window: at the edge, by body and by path, same answer, no queue check.
            for path, body in [
                ("/v1/embeddings", {"model": "emb", "input": "e1"}),
                ("/models/emb/embed", {"input": "e2"}),
            ]:
                r = await client.post(path, json=body)
                assert r.status_code == 503, r.text
                assert int(r.headers["Retry-After"]) >= 1
                assert r.headers["X-Hub-Model-Version"] == "1"
                message = r.json()["error"]["message"]
                assert EDGE in message and "max_queue_time_ms (25)" in message
            assert checks == []
            # A version named with @ goes to its queue (refused there), with its body intact.
            pinned = await client.post("/v1/embeddings", json={"model": "emb@1", "input": "p"})
            assert pinned.status_code == 503 and EDGE not in pinned.text
            assert checks == [1]
            # Another model is served, its body read at the edge and handed on unchanged.
            other = await client.post(
                "/v1/embeddings", json={"model": "other", "input": ["x", "y"]}
            )
            assert other.status_code == 200 and len(other.json()["data"]) == 2
            # Past the window (5 ms): the whole way again.
            now[0] += 0.006
            late = await client.post("/v1/embeddings", json={"model": "emb", "input": "l"})
            assert late.status_code == 503 and EDGE not in late.text
            assert checks == [1, 1]
        finally:
            parked.release()
        assert (await first).status_code == 200
        assert all(r.status_code == 200 for r in await asyncio.gather(*queued))
    metrics = (await client.get("/metrics")).text
    # 1 + 1 + 1 by the queue, 2 at the edge: one series, and all five answered requests.
    assert 'hub_requests_shed_total{model="emb",reason="queue_time",version="1"} 5.0' in metrics
    answered = 'hub_requests_total{endpoint="embeddings",model="emb",status="503",version="1"}'
    assert f"{answered} 5.0" in metrics


async def test_only_a_known_caller_on_a_route_of_the_models_kind_is_refused_at_the_edge(
    tmp_path: Path, mlflow_template: Path, tiny_embedder_dir: Path
) -> None:
    """A refusal at the edge says how loaded a model is: a caller without a valid key gets
    its 401, and a route of another kind its 400, as if the model were idle; a key the hub
    has not verified yet goes the whole way once (here: served, the queue being empty)."""
    from backends.errors import CapacityError
    from tests.support.hubs import ADMIN as admin
    from tests.support.hubs import auth_settings, running_app

    settings, user_key = auth_settings(tmp_path / "hub", mlflow_template)
    user = {"Authorization": f"Bearer {user_key}"}
    async with running_app(settings) as (app, client):
        body = {"name": "emb", "kind": "embedder", "source": str(tiny_embedder_dir)}
        assert (await client.post("/admin/registry/models", json=body, headers=admin)).is_success
        saturation = app.state.hub.saturation
        saturation._clock = lambda: 0.0
        saturation.mark("emb", 1, "embedder", CapacityError("emb is busy", saturated_s=10))
        request = {"model": "emb", "input": "hi"}
        assert (await client.post("/v1/embeddings", json=request)).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert (await client.post("/v1/embeddings", json=request, headers=wrong)).status_code == 401
        rerank = {"model": "emb", "query": "q", "documents": ["d"]}
        r = await client.post("/v1/rerank", json=rerank, headers=admin)
        assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_model_kind"
        r = await client.post("/v1/embeddings", json=request, headers=admin)
        assert r.status_code == 503 and EDGE in r.text
        first = await client.post("/v1/embeddings", json=request, headers=user)
        assert first.status_code == 200  # not verified yet: routed, and the queue is empty
        again = await client.post("/v1/embeddings", json=request, headers=user)
        assert again.status_code == 503 and EDGE in again.text
