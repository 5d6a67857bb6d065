"""A load that runs past `manager.load_timeout` is cancelled: its worker thread stops between
tensors, the room it held is given back (`/admin/devices` as before it), the requests get 503
with the reason, and the model loads on the next request, with no backoff."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open

import backends.loading
from hub.settings import HubSettings
from tests.support.hubs import running_app

# Long enough for the tiny model's real load on a busy machine; the slowed one reads a tensor
# per half of it.
LOAD_TIMEOUT = 5.0
SECONDS_PER_TENSOR = LOAD_TIMEOUT / 2


def _tensor_count(folder: Path) -> int:
    count = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            count += len(list(f.keys()))
    return count


async def _used_bytes(client: httpx.AsyncClient) -> int:
    devices = (await client.get("/admin/devices")).json()["devices"]
    return sum(d["used_bytes"] for d in devices)


async def _state(client: httpx.AsyncClient) -> str:
    models = (await client.get("/admin/models")).json()
    return next((m["state"] for m in models if m["name"] == "tiny"), "unknown")


async def test_a_load_past_its_timeout_is_cancelled_and_gives_its_room_back(
    settings: HubSettings, tiny_llm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = _tensor_count(tiny_llm_dir)
    assert tensors * SECONDS_PER_TENSOR > 3 * LOAD_TIMEOUT  # the slowed load cannot finish

    read = backends.loading._read_tensors
    reads: list[str] = []
    slow = threading.Event()
    slow.set()

    def slowed(path: Path, device: str) -> Iterator[tuple[str, torch.Tensor]]:
        for key, tensor in read(path, device):
            reads.append(key)
            if slow.is_set():
                time.sleep(SECONDS_PER_TENSOR)  # a load slowed by a slow disk
            yield key, tensor

    monkeypatch.setattr(backends.loading, "_read_tensors", slowed)
    manager = settings.manager.model_copy(update={"load_timeout": LOAD_TIMEOUT})
    async with running_app(settings.model_copy(update={"manager": manager})) as (_app, client):
        body = {"name": "tiny", "kind": "llm", "source": str(tiny_llm_dir)}
        assert (await client.post("/admin/registry/models", json=body)).status_code == 201
        before = await _used_bytes(client)
        request = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        r = await client.post("/v1/completions", json=request)
        assert r.status_code == 503 and r.json()["error"]["code"] == "load_timeout", r.text
        # The load's own outcome comes once its thread has stopped and its room is released.
        for _ in range(200):
            if await _state(client) != "loading":
                break
            await asyncio.sleep(0.05)
        assert await _state(client) == "unloaded"
        assert await _used_bytes(client) == before
        stopped_at = len(reads)
        assert stopped_at < tensors, "the load read every tensor despite its timeout"
        metrics = (await client.get("/metrics")).text
        assert 'outcome="timeout"' in metrics
        # Retryable at once (no backoff), and loads when it is fast enough.
        slow.clear()
        r = await client.post("/v1/completions", json=request)
        assert r.status_code == 200, r.text
        assert await _state(client) == "loaded"
        assert await _used_bytes(client) > before
