"""The reconciler directly (no HTTP): alias drift between MLflow and SQL is recorded and
followed, and a configured model's new serving version is loaded (and pinned) for it."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from hub.catalog import Catalog
from hub.control import Control, build_registry
from hub.metrics import HubMetrics
from hub.reconciler import Reconciler
from registry.db import upgrade
from registry.service import Registry
from tests.support.hubs import make_settings


class RecordingManager:
    """The manager calls the reconciler makes, recorded instead of loading anything."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []

    async def load(self, name: str, version: int) -> None:
        self.calls.append(("load", name, version))

    async def pin(self, name: str, version: int) -> None:
        self.calls.append(("pin", name, version))

    async def unpin(self, name: str, version: int) -> None:
        self.calls.append(("unpin", name, version))


@pytest.fixture
def registry(tmp_path: Path, mlflow_template: Path) -> Registry:
    settings = make_settings(tmp_path / "hub", mlflow_template)
    upgrade(settings.database_url)
    return build_registry(settings)


def reconciler(
    registry: Registry, *, keep_loaded: frozenset[str] = frozenset(),
    pinned: frozenset[str] = frozenset(),
) -> tuple[Reconciler, RecordingManager, HubMetrics]:  # fmt: skip
    manager, metrics = RecordingManager(), HubMetrics()
    control = Control(registry, Catalog(registry))
    r = Reconciler(control, manager, metrics, poll_interval=60,  # type: ignore[arg-type]
                   keep_loaded=keep_loaded, pinned=pinned)  # fmt: skip
    return r, manager, metrics


async def settle(r: Reconciler) -> None:
    """Wait for the preloads a pass started."""
    await asyncio.gather(*list(r._followups))


async def test_alias_drift_in_mlflow_is_recorded_and_served(
    registry: Registry, tiny_embedder_dir: Path
) -> None:
    registry.register("emb", "embedder", str(tiny_embedder_dir), aliases=["production"])
    registry.register("emb", "embedder", str(tiny_embedder_dir))
    r, _, metrics = reconciler(registry)
    await r.reconcile(check_versions=True)
    assert r.control.catalog.model("emb").default_version() == 1
    assert r.drift == []
    # Someone moves production in MLflow's UI, behind the hub's back.
    registry.mlflow.client.set_registered_model_alias("emb", "production", "2")
    await r.reconcile()
    assert r.control.catalog.model("emb").default_version() == 2
    [item] = r.drift
    assert (item.model, item.kind, item.repaired) == ("emb", "alias", True)
    assert metrics.registry_drift.labels("alias")._value.get() == 0  # repaired: recorded
    [event, *_] = registry.events("emb")
    assert (event.alias, event.version, event.from_version) == ("production", 2, 1)
    assert r.rounds == 2


async def test_a_pinned_model_follows_its_serving_version(
    registry: Registry, tiny_embedder_dir: Path
) -> None:
    registry.register("emb", "embedder", str(tiny_embedder_dir), aliases=["production"])
    registry.register("emb", "embedder", str(tiny_embedder_dir))
    registry.register("other", "embedder", str(tiny_embedder_dir))
    r, manager, _ = reconciler(registry, pinned=frozenset({"emb"}))
    await r.reconcile()
    await settle(r)
    manager.calls.clear()  # the first pass saw everything as new
    registry.set_alias("emb", "production", 2, actor="test")
    registry.register("other", "embedder", str(tiny_embedder_dir))  # not configured
    await r.reconcile()
    await settle(r)
    assert manager.calls == [("pin", "emb", 2), ("unpin", "emb", 1)]


async def test_a_preloaded_model_gets_its_new_version_loaded_not_pinned(
    registry: Registry, tiny_embedder_dir: Path
) -> None:
    registry.register("emb", "embedder", str(tiny_embedder_dir))
    r, manager, _ = reconciler(registry, keep_loaded=frozenset({"emb"}))
    await r.reconcile()
    await settle(r)
    manager.calls.clear()
    registry.register("emb", "embedder", str(tiny_embedder_dir))  # latest becomes v2
    await r.reconcile()
    await settle(r)
    assert manager.calls == [("load", "emb", 2)]


async def test_a_failed_pass_keeps_the_last_snapshot(
    registry: Registry, tiny_embedder_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry.register("emb", "embedder", str(tiny_embedder_dir))
    r, _, _ = reconciler(registry)
    await r.reconcile()

    def down() -> None:
        raise ConnectionError("database unreachable")

    monkeypatch.setattr(registry, "snapshot", down)
    with pytest.raises(ConnectionError):
        await r.reconcile()
    assert r.control.catalog.model("emb").default_version() == 1


async def test_stop_logs_an_error_its_loop_ended_with(caplog: pytest.LogCaptureFixture) -> None:
    class BrokenLoop(Reconciler):
        async def _loop(self) -> None:
            raise RuntimeError("a bug in the loop")

    control = SimpleNamespace(catalog=SimpleNamespace(on_change=lambda listener: None))
    r = BrokenLoop(control, RecordingManager(), HubMetrics(), poll_interval=60)  # type: ignore[arg-type]
    r.start()
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="hub.reconciler"):
        await r.stop()  # the shutdown's next steps still run
    [record] = caplog.records
    assert record.exc_info is not None and "a bug in the loop" in str(record.exc_info[1])
