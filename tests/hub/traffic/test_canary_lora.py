"""Traffic between LoRA adapter versions: the gate runs the candidate adapter on its base,
a canary with an injected error rate is rolled back, a healthy one is promoted, the readout
counts each adapter version (clock and faults injected, no sleeping); shadow traffic between
adapter versions and a split between an adapter and its base work as for any model."""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.backends.llm.lora_support import ALL_LINEAR, ATTENTION, build_adapter
from tests.hub.traffic.test_shadow import shadow_row
from tests.support.hubs import make_settings, running_app
from tests.support.traffic_hub import register

HOUR = 3600.0
_keys = itertools.count()


@pytest.fixture(scope="module")
def adapters(tiny_llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("lora-canary")
    return [
        build_adapter(tiny_llm_dir, root / "v1", ATTENTION, seed=1),
        build_adapter(tiny_llm_dir, root / "v2", ALL_LINEAR, seed=2),
    ]


async def traffic_until(client: httpx.AsyncClient, need: dict[str, int]) -> None:
    """Routed requests for `bot` (distinct route keys) until each version in `need` has
    answered that many (errors included)."""
    got = dict.fromkeys(need, 0)
    body = {"prompt_token_ids": [3, 14, 15, 92], "max_tokens": 2, "temperature": 0}
    for _ in range(400):
        if all(got[v] >= n for v, n in need.items()):
            return
        headers = {"X-Hub-Route-Key": f"user-{next(_keys)}"}
        r = await client.post("/models/bot/generate", json=body, headers=headers)
        version = r.headers["X-Hub-Model-Version"]
        got[version] = got.get(version, 0) + 1
    raise AssertionError(f"the versions served {got}, need {need}")


async def test_adapter_canaries_roll_back_on_errors_and_promote_when_healthy(
    tmp_path: Path, mlflow_template: Path, tiny_llm_dir: Path, adapters: list[Path]
) -> None:
    settings = make_settings(tmp_path / "hub", mlflow_template, traffic={"canary_tick": "1h"})
    now = time.time()

    def later() -> float:
        nonlocal now
        now = max(now, time.time()) + HOUR + 1
        return now

    async with running_app(settings) as (app, client):
        controller = app.state.hub.traffic.canaries
        app.state.hub.traffic.faults.rng = random.Random(7)  # the 50% fault, reproducibly
        await register(client, "tiny", tiny_llm_dir, kind="llm", aliases=["production"])
        await register(client, "bot", adapters[0], kind="llm", base="tiny@1",
                       aliases=["production"])  # fmt: skip
        await register(client, "bot", adapters[1], kind="llm", base="tiny@production")
        r = await client.post("/admin/registry/models/bot/versions/2/promote",
                              json={"to": "staging"})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["validation"]["passed"] is True  # the gate ran v2 on its base

        spec: dict[str, Any] = {"version": 2, "steps": [50, 100], "interval": "1h",
                                "min_requests": 10, "max_latency_ratio": 20}  # fmt: skip
        r = await client.put("/admin/traffic/bot", json={
            "splits": [{"version": 1, "weight": 100}],
            "faults": [{"version": 2, "error_percent": 50}],
        })  # fmt: skip
        assert r.status_code == 200, r.text
        assert (await client.post("/admin/traffic/bot/canary", json=spec)).status_code == 201
        await traffic_until(client, {"1": 10, "2": 10})
        readout = (await client.get("/admin/traffic/bot/readout")).json()
        rows = {v["version"]: v for v in readout["versions"]}  # per adapter version
        assert rows["1"]["requests"] >= 10 and rows["2"]["errors"] > 0
        assert await controller.tick(now=later()) == {"bot": "rolled_back"}
        status = (await client.get("/admin/traffic/bot/canary")).json()
        assert status["state"] == "rolled_back" and "error rate" in status["reason"]

        r = await client.put("/admin/traffic/bot", json={"splits": [{"version": 1, "weight": 100}]})
        assert r.status_code == 200, r.text
        assert (await client.post("/admin/traffic/bot/canary", json=spec)).status_code == 201
        await traffic_until(client, {"1": 10, "2": 10})
        assert await controller.tick(now=later()) == {"bot": "advanced"}
        await traffic_until(client, {"2": 10})
        assert await controller.tick(now=later()) == {"bot": "promoted"}
        models = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
        assert models["bot"]["aliases"]["production"] == 2
        assert models["tiny"]["aliases"]["production"] == 1  # the base is untouched

        # Shadow: v1 mirrors v2's greedy requests; two adapters' outputs differ.
        policy = {
            "splits": [{"version": 2, "weight": 100}],
            "shadow": {"version": 1, "percent": 100},
        }
        assert (await client.put("/admin/traffic/bot", json=policy)).status_code == 200
        await traffic_until(client, {"2": 3})
        await app.state.hub.traffic.shadow.drain()
        readout = (await client.get("/admin/traffic/bot/readout")).json()
        mirrored = shadow_row(readout, "1")
        assert mirrored["similarity"]["compared"] >= 3 and mirrored["similarity"]["mean"] < 1

        # A split between the adapter and its base, under the adapter's name.
        split = [{"model": "tiny", "version": 1, "weight": 50}, {"version": 2, "weight": 50}]
        assert (await client.put("/admin/traffic/bot", json={"splits": split})).status_code == 200
        await traffic_until(client, {"tiny@1": 3, "2": 3})
