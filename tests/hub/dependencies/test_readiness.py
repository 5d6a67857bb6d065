"""`/health/ready` means "this replica can serve": not before the configured
preloads have finished (the first requests used to wait 18 s for a load), and it never calls
a dependency itself; and MLflow's bounded calls never pile up threads."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from backends.encoders.embedder import EmbedderBackend
from hub.dependencies import BoundedCalls
from registry.errors import DependencyUnavailable
from tests.support.hubs import make_settings, running_app


async def test_not_ready_until_the_configured_preloads_are_done(
    tmp_path: Path,
    mlflow_template: Path,
    tiny_embedder_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    load = EmbedderBackend.load

    def held_load(self: EmbedderBackend, *args: object, **kwargs: object) -> None:
        # The preload's weights arrive when the test says so (a slow disk, a big model).
        release.wait(timeout=120)
        load(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(EmbedderBackend, "load", held_load)
    models = [{"name": "emb", "kind": "embedder", "source": str(tiny_embedder_dir),
               "preload": True}]  # fmt: skip
    settings = make_settings(tmp_path / "hub", mlflow_template, models=models)
    async with running_app(settings) as (_, client):
        r = await client.get("/health/ready")
        assert r.status_code == 503, r.text
        assert r.json()["status"] == "preloading"
        assert r.json()["waiting_for"] == ["emb"]
        assert (await client.get("/health")).json()["ready"] is False
        release.set()
        deadline = time.monotonic() + 120
        while (r := await client.get("/health/ready")).status_code != 200:
            assert time.monotonic() < deadline, r.text
            await asyncio.sleep(0.05)
        body = r.json()
        assert body["status"] == "ready"
        assert body["dependencies"]["database"]["up"] is True
        assert body["dependencies"]["mlflow"]["up"] is True
        # Ready means the preloaded model is resident: no request waits for its load.
        [model] = (await client.get("/admin/models")).json()
        assert (model["name"], model["state"]) == ("emb", "loaded")


async def test_calls_to_a_stuck_dependency_never_pile_up_threads() -> None:
    stuck = threading.Event()
    calls = BoundedCalls("mlflow", workers=2, deadline=0.2)

    def hangs() -> None:
        stuck.wait(timeout=60)

    before = threading.active_count()
    try:
        outcomes = await asyncio.gather(*(calls.run(hangs) for _ in range(20)),
                                        return_exceptions=True)  # fmt: skip
        assert all(isinstance(o, DependencyUnavailable) for o in outcomes)
        messages = [str(o) for o in outcomes]
        assert sum("did not answer hangs within 0.2s" in m for m in messages) == 2
        assert sum("busy" in m for m in messages) == 18
        assert threading.active_count() <= before + 2
        assert calls.busy == 2
    finally:
        stuck.set()
        calls.close()
    deadline = time.monotonic() + 30
    while calls.busy:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
