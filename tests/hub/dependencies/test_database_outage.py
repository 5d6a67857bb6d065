"""PostgreSQL stopped under a running hub, then started again.

While the database is away: resident models keep serving, a load that needs the database is
answered 503 with Retry-After (the model is not blamed: no failure backoff), registry and
traffic routes answer 503 in OpenAI's error shape, and readiness turns 503 once the grace
period has passed. As soon as it is back: the hub is ready and the model loads at the next
request (it used to answer 503 for ~104 s: the backoff of the failures made meanwhile).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from tests.support.hubs import make_settings, running_app
from tests.support.postgres import postgres_server
from tests.support.traffic_hub import embed, register


async def until(client: httpx.AsyncClient, path: str, status: int, within: float = 60) -> None:
    """Poll `path` until it answers `status` (a hang guard, not a timing claim)."""
    deadline = time.monotonic() + within
    while (await client.get(path)).status_code != status:
        assert time.monotonic() < deadline, f"{path} never answered {status}"
        await asyncio.sleep(0.1)


def assert_unavailable(r: httpx.Response, code: str) -> None:
    assert r.status_code == 503, r.text
    assert int(r.headers["Retry-After"]) >= 1
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", code), error
    assert "database" in error["message"], error


async def test_a_database_outage_degrades_only_what_needs_it(
    tmp_path: Path, mlflow_template: Path, tiny_embedder_dir: Path
) -> None:
    with postgres_server(("hub",)) as pg:
        settings = make_settings(
            tmp_path / "hub",
            mlflow_template,
            database_url=pg.urls["hub"],
            registry={"poll_interval": 0.5, "health_interval": 0.2, "database_grace": 1,
                      "database_timeout": 3},
        )  # fmt: skip
        async with running_app(settings) as (_, client):
            await register(client, "resident", tiny_embedder_dir, aliases=["production"])
            await register(client, "cold", tiny_embedder_dir, aliases=["production"])
            assert (await embed(client, "resident")).status_code == 200
            pg.stop()
            try:
                # More failed loads than the backoff ladder has steps (1, 5, 30, 120 s).
                for _ in range(5):
                    assert_unavailable(await embed(client, "cold"), "database_unavailable")
                assert (await embed(client, "resident")).status_code == 200
                for r in (
                    await client.get("/admin/registry/models/cold/versions"),
                    await client.get("/admin/registry/events"),
                    await client.put("/admin/traffic/cold", json={"splits": [
                        {"version": 1, "weight": 100}]}),
                ):  # fmt: skip
                    assert_unavailable(r, "dependency_unavailable")
                await until(client, "/health/ready", 503)
                body = (await client.get("/health/ready")).json()
                assert body["status"] == "registry database unavailable"
                assert body["dependencies"]["database"]["up"] is False
                assert (await client.get("/health/live")).status_code == 200
            finally:
                pg.start()
            await until(client, "/health/ready", 200)
            r = await embed(client, "cold")
            assert r.status_code == 200, r.text
            models = {m["name"]: m for m in (await client.get("/admin/models")).json()}
            assert models["cold"]["state"] == "loaded"
            metrics = (await client.get("/metrics")).text
            assert 'hub_model_loads_total{model="cold",outcome="dependency_down"' in metrics
            assert 'hub_dependency_up{dependency="database"} 1.0' in metrics
