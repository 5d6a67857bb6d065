"""Refusal at the HTTP edge (`max_requests_in_progress`): past the bound a new request gets
503 + Retry-After in the error shape at once, probes and metrics still answer, nothing is
lost, and a stream holds its place until it ends."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest

from backends.llm.engine import LLMEngine
from hub.settings import HubSettings
from tests.hub.api.test_embeddings import ParkedForward, until_queued
from tests.support.hubs import running_app
from tests.support.live import live_hub

LIMIT = 3
BURST = 12


def _shed_count(metrics: str) -> float:
    line = 'hub_requests_shed_total{model="",reason="in_progress",version=""} '
    found = [ln for ln in metrics.splitlines() if ln.startswith(line)]
    assert found, "no in_progress shed counter in /metrics"
    return float(found[0].removeprefix(line))


def _assert_refused(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert int(r.headers["Retry-After"]) >= 1
    error = r.json()["error"]
    assert error["type"] == "service_unavailable" and error["code"] == "overloaded"
    assert f"{LIMIT} requests are in progress" in error["message"]
    assert "max_requests_in_progress" in error["message"]


async def _register(client: httpx.AsyncClient, folder: Path) -> None:
    body = {"name": "emb", "kind": "embedder", "source": str(folder),
            "config": {"max_batch_size": 1, "forward_workers": 1}}  # fmt: skip
    assert (await client.post("/admin/registry/models", json=body)).status_code == 201
    assert (await client.post("/models/emb/embed", json={"input": "warm"})).status_code == 200


async def test_a_burst_over_the_limit_is_refused_with_503_and_none_is_lost(
    settings: HubSettings, tiny_embedder_dir: Path
) -> None:
    limited = settings.model_copy(update={"max_requests_in_progress": LIMIT})
    async with running_app(limited) as (app, client):
        await _register(client, tiny_embedder_dir)
        async with app.state.hub.manager.acquire("emb", 1) as backend:
            parked = ParkedForward(backend)
            try:
                # LIMIT requests in progress: one in the parked forward pass, the rest queued.
                held = [asyncio.create_task(client.post("/models/emb/embed", json={"input": "a"}))]
                await asyncio.to_thread(parked.entered.wait, 30)
                held += [
                    asyncio.create_task(
                        client.post("/v1/embeddings", json={"model": "emb", "input": f"q{i}"})
                    )
                    for i in range(LIMIT - 1)
                ]
                await until_queued(backend, LIMIT - 1)
                # Answered while the model is parked: nothing of them waits for it.
                burst = await asyncio.gather(
                    *(
                        client.post("/v1/embeddings", json={"model": "emb", "input": f"b{i}"})
                        for i in range(BURST)
                    )
                )
                for r in burst:
                    _assert_refused(r)
                # Probes and metrics are exempt.
                assert (await client.get("/health/live")).status_code == 200
                assert _shed_count((await client.get("/metrics")).text) == BURST
            finally:
                parked.release()
            for r in await asyncio.gather(*held):
                assert r.status_code == 200 and len(r.json()["data"]) == 1
        # Room again: the next request is served.
        after = await client.post("/v1/embeddings", json={"model": "emb", "input": "later"})
        assert after.status_code == 200


def test_a_stream_counts_until_it_ends(
    settings: HubSettings, tiny_llm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Engine steps pass only while `running` is set: the stream is held mid-way at will.
    running = threading.Event()
    running.set()
    step = LLMEngine.step
    monkeypatch.setattr(LLMEngine, "step", lambda self: running.wait(30) and step(self))
    limited = settings.model_copy(update={"max_requests_in_progress": 1})
    with live_hub(limited) as (base, _app), httpx.Client(base_url=base, timeout=60) as client:
        r = client.post(
            "/admin/registry/models",
            json={"name": "tiny", "kind": "llm", "source": str(tiny_llm_dir)},
        )
        assert r.status_code == 201, r.text
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 64,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with client.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert stream.status_code == 200 and next(lines).startswith("data: ")
            running.clear()  # at most one more step: the stream cannot end
            refused = client.get("/v1/models")
            assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
            assert "1 requests are in progress" in refused.json()["error"]["message"]
            assert client.get("/health/ready").status_code == 200
            running.set()
            events = [line for line in lines if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
        # The stream has ended: its place is free once the server has sent its last byte.
        answers = []
        for _ in range(200):
            answers.append(client.get("/v1/models").status_code)
            if answers[-1] == 200:
                break
            time.sleep(0.05)
        assert answers[-1] == 200 and set(answers) <= {200, 503}, answers


async def test_a_request_arriving_while_the_event_loop_is_behind_is_refused(
    settings: HubSettings,
) -> None:
    lagging = settings.model_copy(update={"max_event_loop_lag": 0.2})
    async with running_app(lagging) as (_app, client):
        assert (await client.get("/v1/models")).status_code == 200  # the loop keeps up
        late = asyncio.create_task(client.get("/v1/models"))
        time.sleep(0.5)  # noqa: ASYNC251 - the loop is stuck: the request arrives 0.5 s late
        r = await late
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        assert "event loop is" in r.json()["error"]["message"]
        assert "max_event_loop_lag (0.2s)" in r.json()["error"]["message"]
        metrics = (await client.get("/metrics")).text
        assert 'hub_requests_shed_total{model="",reason="event_loop_lag",version=""} 1.0' in metrics
        # Caught up: served again.
        answers = []
        for _ in range(100):
            await asyncio.sleep(0.05)
            answers.append((await client.get("/v1/models")).status_code)
            if answers[-1] == 200:
                break
        assert answers[-1] == 200 and set(answers) <= {200, 503}, answers
