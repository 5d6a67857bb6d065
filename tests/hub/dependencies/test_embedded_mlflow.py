"""The embedded MLflow (a SQLite store beside the hub) is created by its first use: MLflow
imports and migrates its database, which takes far longer than a network call may. That is
the hub making its own store, not an outage: no "unreachable" warning, and MLflow is up once
the hub has started. A dependency reached over the network that does not answer its first
check in time is still reported down at once."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import pytest

from hub.dependencies import DependencyMonitor
from tests.support.hubs import make_settings, running_app

DEADLINE = 0.05


class SlowFirstCheck:
    """A check whose first call blocks until released (a store being created); later
    calls answer at once."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> None:
        if not self.started.is_set():
            self.started.set()
            assert self.release.wait(timeout=60)


async def test_a_store_created_by_its_first_check_is_awaited_whole(
    caplog: pytest.LogCaptureFixture,
) -> None:
    check = SlowFirstCheck()
    monitor = DependencyMonitor(
        {"mlflow": check},
        interval=60,
        timeout=DEADLINE,
        created_on_first_use={"mlflow"},
    )
    with caplog.at_level(logging.WARNING):
        first = asyncio.create_task(monitor.check_now())
        assert await asyncio.to_thread(check.started.wait, 60)
        # Well past the deadline: still being created, neither up nor down.
        await asyncio.sleep(10 * DEADLINE)
        assert not first.done() and monitor.state("mlflow").up is None
        check.release.set()
        await first
    assert monitor.state("mlflow").up is True
    assert "unreachable" not in caplog.text
    await monitor.stop()


async def test_a_remote_dependency_silent_past_its_deadline_is_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    check = SlowFirstCheck()
    monitor = DependencyMonitor({"mlflow": check}, interval=60, timeout=DEADLINE)
    with caplog.at_level(logging.WARNING):
        await monitor.check_now()
    check.release.set()
    assert monitor.state("mlflow").up is False
    assert "mlflow is unreachable" in caplog.text
    await monitor.stop()


async def test_the_first_start_creates_embedded_mlflow_without_an_outage_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # No template: the hub creates (migrates) its MLflow database itself, as a fresh clone
    # does; the tightest deadlines the settings allow.
    settings = make_settings(
        tmp_path / "hub", None, registry={"mlflow_timeout": 1, "database_timeout": 0.5}
    )
    assert not (tmp_path / "hub" / "mlflow.db").exists()
    with caplog.at_level(logging.WARNING):
        async with running_app(settings) as (_, client):
            ready = (await client.get("/health/ready")).json()
    assert ready["dependencies"]["mlflow"]["up"] is True, ready
    assert (tmp_path / "hub" / "mlflow.db").exists()
    assert "unreachable" not in caplog.text.lower()
