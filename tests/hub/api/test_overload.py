"""Overload over HTTP: a burst against a tiny embedder with `max_queue_time_ms` is shed with
503 + Retry-After naming the queue's state, every other request is answered 200, and the
shed requests are counted per model and reason; with no bound the same burst is all served.

The embedder's forward pass is parked while the burst arrives, and its cost per input is set,
so the queue each request meets is known exactly (no timing in the assertions)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.hub.api.test_embeddings import ParkedForward, until_queued

if TYPE_CHECKING:
    import httpx
    from fastapi import FastAPI

BURST = 10


async def _burst(
    app: FastAPI, client: httpx.AsyncClient, folder: Path, config: dict[str, Any], admitted: int
) -> list[httpx.Response]:
    """Register `emb` with `config`, park its forward pass on a first request, send BURST
    one-input requests at once with an input measured at 10 ms, wait until `admitted` of them
    queue and the rest are answered, then let the model run: every answer."""
    body = {"name": "emb", "kind": "embedder", "source": str(folder),
            "config": {"max_batch_size": 1, "forward_workers": 1, **config}}  # fmt: skip
    assert (await client.post("/admin/registry/models", json=body)).status_code == 201
    async with app.state.hub.manager.acquire("emb", 1) as backend:
        parked = ParkedForward(backend)
        try:
            first = asyncio.create_task(client.post("/models/emb/embed", json={"input": "a"}))
            await asyncio.to_thread(parked.entered.wait, 30)
            batcher = backend._batcher
            batcher.admission.observe(1, 0.010)
            # The batcher's clock stops where the parked pass has run exactly its measured
            # 10 ms: none of it is left and it shows no contention, so each arrival meets
            # only the queue ahead of it (a parked pass on a running clock would look ever
            # slower and turn everything away).
            ((_, started),) = batcher.work.running
            batcher.work.clock = lambda: started + 0.010
            burst = [
                asyncio.create_task(
                    client.post("/v1/embeddings", json={"model": "emb", "input": f"text {i}"})
                )
                for i in range(BURST)
            ]
            await until_queued(backend, admitted)
            pending: set[asyncio.Task[httpx.Response]] = set(burst)
            while len(pending) > admitted:  # the refusals are answered while the model waits
                done, pending = await asyncio.wait(
                    pending, timeout=30, return_when=asyncio.FIRST_COMPLETED
                )
                assert done, "a request neither queued nor answered within 30 s"
        finally:
            parked.release()
        assert (await first).status_code == 200
        return list(await asyncio.gather(*burst))


async def test_a_burst_beyond_max_queue_time_is_shed_with_503_and_the_rest_served(
    app_client: tuple[FastAPI, httpx.AsyncClient], tiny_embedder_dir: Path
) -> None:
    app, client = app_client
    # 0, 10 and 20 ms of queue fit 25 ms: three are admitted, whatever order they arrive in.
    answers = await _burst(app, client, tiny_embedder_dir, {"max_queue_time_ms": 25}, 3)
    served = [r for r in answers if r.status_code == 200]
    shed = [r for r in answers if r.status_code == 503]
    assert len(served) == 3 and len(shed) == BURST - 3, [r.status_code for r in answers]
    for r in served:
        assert len(r.json()["data"]) == 1
    for r in shed:
        assert int(r.headers["Retry-After"]) >= 1
        error = r.json()["error"]
        assert error["type"] == "service_unavailable"
        assert "3 inputs wait ahead" in error["message"]
        assert "max_queue_time_ms (25)" in error["message"]
    metrics = (await client.get("/metrics")).text
    assert 'hub_requests_shed_total{model="emb",reason="queue_time",version="1"} 7.0' in metrics
    assert 'hub_requests_shed_total{model="emb",reason="queue_full",version="1"} 0.0' in metrics


async def test_with_no_max_queue_time_the_same_burst_is_all_served(
    app_client: tuple[FastAPI, httpx.AsyncClient], tiny_embedder_dir: Path
) -> None:
    app, client = app_client
    answers = await _burst(app, client, tiny_embedder_dir, {}, BURST)
    assert [r.status_code for r in answers] == [200] * BURST
    metrics = (await client.get("/metrics")).text
    assert 'hub_requests_shed_total{model="emb",reason="queue_time",version="1"} 0.0' in metrics
