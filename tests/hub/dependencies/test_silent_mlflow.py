"""An MLflow that accepts connections and never answers (a hung server, a black-holed
route): the nastier outage, since nothing fails until a timeout does.

The hub still starts and is ready, probes answer at once without starting a thread, and a
call that needs MLflow is refused with 503 within its bounds: MLflow's client timeout
(`registry.mlflow_timeout`), its own threads (`registry.mlflow_workers`, more calls are
refused at once) and no retries for minutes."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.hubs import make_settings, running_app

# Counts the process's threads: another worker's tests on the same cores make the hub's own
# background work overlap more (more pooled threads), so it runs in the serial pass.
pytestmark = pytest.mark.serial


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A listening socket nobody accepts from: connections complete, requests never answer."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


async def test_a_silent_mlflow_costs_bounded_time_and_threads(
    tmp_path: Path, silent_server: str, tiny_embedder_dir: Path
) -> None:
    settings = make_settings(
        tmp_path / "hub",
        mlflow_tracking_uri=silent_server,
        registry={"poll_interval": 0.5, "health_interval": 0.2, "mlflow_timeout": 1,
                  "mlflow_max_retries": 0, "mlflow_workers": 2, "mlflow_deadline": 5},
    )  # fmt: skip
    async with running_app(settings) as (_, client):
        r = await client.get("/health/ready")
        assert r.status_code == 200, r.text
        assert r.json()["dependencies"]["mlflow"]["up"] is False
        assert r.json()["drift_check"] == "paused"

        # asyncio's default executor starts its threads (at most a handful) on demand as the
        # app's `to_thread` work comes; start them all now, so that growth below means calls
        # piling up, not the pool filling.
        await asyncio.gather(*(asyncio.to_thread(time.sleep, 0.05) for _ in range(64)))
        threads = threading.active_count()
        probes = await asyncio.gather(*(client.get("/health/ready") for _ in range(50)))
        assert all(p.status_code == 200 for p in probes)
        # A probe starts no thread (each used to start one, stuck in MLflow's retries); the
        # slack is for the hub's own background work starting a pooled thread meanwhile.
        assert threading.active_count() <= threads + 2

        # Registrations need MLflow: each fails on the client's timeout; past the two
        # workers the others are refused at once. None retries for minutes.
        body = {"name": "emb", "kind": "embedder", "source": str(tiny_embedder_dir)}
        start = time.monotonic()
        answers = await asyncio.gather(
            *(client.post("/admin/registry/models", json=body) for _ in range(6))
        )
        elapsed = time.monotonic() - start
        assert [a.status_code for a in answers] == [503] * 6, [a.text for a in answers]
        assert all(a.json()["error"]["code"] == "dependency_unavailable" for a in answers)
        assert all("mlflow" in a.json()["error"]["message"].lower() for a in answers)
        assert sum("busy" in a.json()["error"]["message"] for a in answers) >= 4
        # A hang guard, generous for a loaded machine; MLflow's defaults took minutes.
        assert elapsed < 60
        # The admin SQL pool ("registry-sql", 4 threads) starts its threads on first use;
        # past that, a second burst of registrations starts none.
        assert threading.active_count() <= threads + 4 + 2
        after_first = threading.active_count()
        again = await asyncio.gather(
            *(client.post("/admin/registry/models", json=body) for _ in range(6))
        )
        assert [a.status_code for a in again] == [503] * 6
        assert threading.active_count() <= after_first + 2
        assert (await client.get("/admin/registry/models/emb/versions")).status_code == 404
