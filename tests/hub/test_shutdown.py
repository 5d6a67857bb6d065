"""A part of the hub that never finishes stopping costs one bounded step of the shutdown,
says what every task was waiting on, and the parts after it still stop."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

import hub.state
from tests.support.hubs import make_settings, running_app


async def test_a_stuck_part_does_not_hang_the_shutdown(
    tmp_path: Path, mlflow_template: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    monkeypatch.setattr(hub.state, "SHUTDOWN_STEP_TIMEOUT", 0.5)
    never = asyncio.Event()

    async def stuck() -> None:
        await never.wait()

    settings = make_settings(tmp_path / "hub", mlflow_template)
    with caplog.at_level(logging.ERROR, logger="hub.state"):
        async with running_app(settings) as (app, client):
            assert (await client.get("/health/ready")).status_code == 200
            running = app.state.hub
            monkeypatch.setattr(running.reconciler, "stop", stuck)
        # Left the lifespan: the stuck step was given up, the later ones ran.
        assert running.dependencies._task is None
        assert running.manager._keep_alive.reaper._task is None
    (record,) = [r for r in caplog.records if "shutdown:" in r.getMessage()]
    message = record.getMessage()
    assert "reconciler did not finish within 0.5s" in message
    assert "stuck (test_shutdown.py" in message  # where the stuck step waits
