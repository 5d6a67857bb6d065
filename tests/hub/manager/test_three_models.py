"""The issue's acceptance test: three real tiny models through the real registry and HTTP
API on a CPU budget that holds only two. Every request succeeds, models are evicted (parked
in the host tier and restored with the same outputs), and at every step the ledger and the
measured bytes stay within the budget."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest

from backends.tiny import build_tiny_embedder
from hub.settings import HubSettings
from hub.state import Hub
from tests.support.hubs import make_settings, running_app
from tests.support.residency import budget_watch, settled

MiB = 2**20
NAMES = ("red", "green", "blue")


@pytest.fixture(scope="module")
def three_embedders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("three")
    return {name: build_tiny_embedder(root / name, seed=i) for i, name in enumerate(NAMES)}


@pytest.fixture
def two_model_settings(tmp_path: Path, mlflow_template: Path) -> HubSettings:
    # Each tiny embedder is predicted at ~32.1 MiB (weights plus the embedder's runtime
    # allowance): 70 MiB holds two of them, never three.
    return make_settings(
        tmp_path / "hub",
        mlflow_template,
        devices=[{"name": "cpu", "memory_budget": "70MiB"}],
        host_cache_budget="256MiB",
        manager={"min_residency": 0, "keep_alive": "10m", "load_timeout": "60s"},
    )


async def check_budget(client: httpx.AsyncClient) -> None:
    [cpu] = (await client.get("/admin/devices")).json()["devices"]
    models = (await client.get("/admin/models")).json()
    on_cpu = [m for m in models if m["device"] == "cpu"]
    assert cpu["used_bytes"] <= cpu["budget_bytes"] == 70 * MiB
    assert sum(m["measured_bytes"] for m in on_cpu) <= cpu["budget_bytes"]
    assert len([m for m in on_cpu if m["state"] == "loaded"]) <= 2


async def test_three_models_on_a_budget_for_two(
    two_model_settings: HubSettings, three_embedders: dict[str, Path]
) -> None:
    async with running_app(two_model_settings) as (app, client):
        hub: Hub = app.state.hub
        for name, folder in three_embedders.items():
            r = await client.post(
                "/admin/registry/models",
                json={"name": name, "kind": "embedder", "source": str(folder)},
            )
            assert r.status_code == 201, r.text
        await hub.catalog.refresh()

        async def embed(name: str) -> list[float]:
            r = await client.post("/v1/embeddings", json={"model": name, "input": "the same"})
            assert r.status_code == 200, r.text
            return list(r.json()["data"][0]["embedding"])

        first: dict[str, list[float]] = {}
        async with budget_watch(hub.manager) as checks:
            for name in ["red", "green", "blue", "red", "blue", "green", "red", "green"] * 2:
                vector = await embed(name)
                np.testing.assert_allclose(vector, first.setdefault(name, vector), rtol=1e-6)
                await check_budget(client)
            # All three at once, many times: each request waits its turn for room.
            vectors = await asyncio.gather(*(embed(n) for n in NAMES * 4))
            for name, vector in zip(NAMES * 4, vectors, strict=True):
                np.testing.assert_allclose(vector, first[name], rtol=1e-6)
            await settled(hub.manager)
            await check_budget(client)
        assert checks[0] > 0

        metrics = (await client.get("/metrics")).text
        evictions = [
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("hub_model_evictions_total{") and 'reason="pressure"' in line
        ]
        # The optimal offline policy (Belady) evicts 4 times in the sequence and once more
        # for the concurrent burst: no policy can do with fewer.
        assert sum(evictions) >= 5
        assert 'source="warm"' in metrics  # restored from the host tier, not reloaded
        devices = (await client.get("/admin/devices")).json()
        assert devices["host_tier"]["models"] >= 1
        states = {m["name"]: m["state"] for m in (await client.get("/admin/models")).json()}
        assert sorted(states.values()).count("loaded") == 2 and "warm" in states.values()
