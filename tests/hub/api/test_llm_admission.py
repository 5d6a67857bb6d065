"""A burst of chat completions against an LLM is shed by the work on its device: with the
hub's `max_queue_time_ms` (the LLM's runtime config leaves the key out), requests whose
estimated wait (the steps the engine's work needs, at its measured step cost) is over the bound get
503 + Retry-After in OpenAI's error shape naming the estimate and the bound, while the
admitted ones complete. The engine's first step is held while the burst arrives and its step
cost is set, so the work each request meets is known exactly (no timing in assertions)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import httpx
    from fastapi import FastAPI

    from hub.settings import HubSettings

BOUND_MS = 25
BURST = 8
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4, "temperature": 0, "ignore_eos": True}  # fmt: skip


@pytest.fixture
def settings(settings: HubSettings) -> HubSettings:
    return settings.model_copy(update={"max_queue_time_ms": BOUND_MS})


async def test_a_chat_burst_over_the_estimated_wait_is_shed_and_the_rest_served(
    app_client: tuple[FastAPI, httpx.AsyncClient], tiny_llm_dir: Path
) -> None:
    app, client = app_client
    body = {"name": "tiny", "kind": "llm", "source": str(tiny_llm_dir),
            "config": {"kv_cache_bytes": "8MiB", "max_num_seqs": 1}}  # fmt: skip
    assert (await client.post("/admin/registry/models", json=body)).status_code == 201
    async with app.state.hub.manager.acquire("tiny", 1) as backend:
        work = backend.engine.work
        runner = backend.engine.runner
        handover = runner.before_forward
        held, release = threading.Event(), threading.Event()

        def hold_the_first_forward() -> None:
            if handover is not None:
                handover()
            if not held.is_set():
                held.set()
                release.wait(30)

        runner.before_forward = hold_the_first_forward
        try:
            first = asyncio.create_task(client.post("/v1/chat/completions", json=BODY))
            assert await asyncio.to_thread(held.wait, 30)
            # One sequence runs at a time (max_num_seqs 1): k requests ahead are 4k steps
            # of decodes and a fraction of one of prompt tokens. At a step of a tenth of the
            # bound, requests meeting one or two requests' work are admitted, one meeting
            # three is not.
            assert work.published.sequences == 1
            work.observe_step(tokens=1, seconds=BOUND_MS / 1000 / 10)
            # The held step shows no contention: its clock stops where it began.
            started = work.step_started
            work.clock = lambda: started
            burst = [
                asyncio.create_task(client.post("/v1/chat/completions", json=BODY))
                for _ in range(BURST)
            ]
            pending: set[asyncio.Task[httpx.Response]] = set(burst)
            while len(pending) > 2:  # the refusals are answered while the engine is held
                done, pending = await asyncio.wait(
                    pending, timeout=30, return_when=asyncio.FIRST_COMPLETED
                )
                assert done, "a request neither queued nor answered within 30 s"
        finally:
            release.set()
        answers = [await first, *await asyncio.gather(*burst)]
    served = [r for r in answers if r.status_code == 200]
    shed = [r for r in answers if r.status_code == 503]
    assert len(served) == 3 and len(shed) == BURST - 2, [r.status_code for r in answers]
    for r in served:
        assert r.json()["choices"][0]["message"]["content"] is not None
    for r in shed:
        assert int(r.headers["Retry-After"]) >= 1
        error = r.json()["error"]
        assert error["type"] == "service_unavailable"
        assert f"max_queue_time_ms ({BOUND_MS})" in error["message"]
        assert "of work is ahead of this request" in error["message"]
    metrics = (await client.get("/metrics")).text
    assert 'hub_requests_shed_total{model="tiny",reason="queue_time",version="1"}' in metrics


def test_the_hub_bound_applies_to_versions_that_leave_the_key_out() -> None:
    from backends.runtime_config import EmbedderConfig, LLMConfig, RuntimeConfig
    from hub.manager.loader import with_queue_time

    assert with_queue_time(LLMConfig.parse({}), 50).max_queue_time_ms == 50
    assert with_queue_time(EmbedderConfig.parse({}), 50).max_queue_time_ms == 50
    # A version's own bound, or its explicit null (no bound), wins.
    assert with_queue_time(LLMConfig.parse({"max_queue_time_ms": 500}), 50).max_queue_time_ms == 500
    assert (
        with_queue_time(LLMConfig.parse({"max_queue_time_ms": None}), 50).max_queue_time_ms is None
    )
    assert with_queue_time(LLMConfig.parse({}), None).max_queue_time_ms is None
    plain = RuntimeConfig.parse({})
    assert with_queue_time(plain, 50) is plain
