"""Replica membership inside one hub: `/admin/replicas` shows this replica with what it holds,
a clean shutdown removes its row, and a database that does not answer only makes heartbeats
fail (counted), without blocking the event loop or piling up calls."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from hub.replicas import Membership, MembershipUnavailable, replica_id
from hub.replicas.metrics import ReplicaMetrics
from hub.settings import HubSettings, ReplicaSettings
from registry.db import upgrade
from registry.replicas import ReplicaBeat, ReplicaBook
from tests.support.hubs import make_settings, running_app


def count(registry: CollectorRegistry, outcome: str) -> float:
    value = registry.get_sample_value("hub_replica_heartbeats_total", {"outcome": outcome})
    return value or 0.0


async def test_admin_replicas_shows_this_replica_and_what_it_holds(
    tmp_path: Path, mlflow_template: Path, tiny_embedder_dir: Path
) -> None:
    settings = make_settings(tmp_path / "hub", mlflow_template, port=8123)
    async with running_app(settings) as (app, client):
        r = await client.post("/admin/registry/models", json={
            "name": "emb", "kind": "embedder", "source": str(tiny_embedder_dir)})  # fmt: skip
        assert r.status_code == 201, r.text
        assert (await client.post("/admin/models/emb/versions/1/load")).status_code == 200
        await app.state.hub.replicas.beat()

        r = await client.get("/admin/replicas")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["this_replica"] == replica_id(settings) == f"{socket.gethostname()}-8123"
        assert body["expire_after_s"] == settings.replica.expire_after
        [me] = body["replicas"]
        assert me["this"] and me["id"] == body["this_replica"]
        assert me["address"] == "http://127.0.0.1:8123"
        assert me["queue_depth"] == 0
        assert me["devices"] == [
            {"name": "cpu", "budget_bytes": 2 * 2**30, "free_bytes": me["devices"][0]["free_bytes"]}
        ]
        [model] = me["models"]
        assert (model["name"], model["version"], model["state"]) == ("emb", 1, "loaded")
        assert model["device"] == "cpu" and model["bytes"] > 0
        assert me["devices"][0]["free_bytes"] == 2 * 2**30 - model["bytes"]

        metrics = (await client.get("/metrics")).text
        assert 'hub_replica_heartbeats_total{outcome="ok"}' in metrics
        assert "hub_queue_depth 0.0" in metrics
        assert f'hub_replica_info{{address="http://127.0.0.1:8123",replica="{me["id"]}"}}' in (
            metrics
        )

    # A clean shutdown deleted the row: nobody lists this replica any more.
    book = ReplicaBook(settings.database_url, timeout=2)
    assert book.live(settings.replica.expire_after) == []
    book.dispose()


async def test_admin_replicas_needs_an_admin_key(tmp_path: Path, mlflow_template: Path) -> None:
    settings = make_settings(
        tmp_path / "hub", mlflow_template, auth={"enabled": True, "bootstrap_admin_key": "boot"}
    )
    async with running_app(settings) as (_, client):
        assert (await client.get("/admin/replicas")).status_code == 401
        r = await client.get("/admin/replicas", headers={"Authorization": "Bearer boot"})
        assert r.status_code == 200 and len(r.json()["replicas"]) == 1


async def eventually(condition: Callable[[], bool]) -> None:
    for _ in range(600):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the condition never became true")


def a_beat() -> ReplicaBeat:
    return ReplicaBeat("me", "http://me:8000", "0.1.0", [], [], 0, 0)


def membership(url: str, registry: CollectorRegistry, sql_timeout: float) -> Membership:
    settings = ReplicaSettings(heartbeat_interval=0.1, expire_after=5, sql_timeout=sql_timeout)
    book = ReplicaBook(url, timeout=sql_timeout)
    metrics = ReplicaMetrics(registry, lambda: 0)
    return Membership(settings, "me", "http://me:8000", book, a_beat, metrics)


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """A TCP port that accepts connections and never says a word: a database that hangs."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield server.getsockname()[1]


async def test_a_hanging_database_fails_heartbeats_without_blocking_the_loop() -> None:
    registry = CollectorRegistry()
    with silent_server() as port:
        m = membership(f"postgresql+psycopg://hub@127.0.0.1:{port}/hub", registry, 0.3)
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticking = asyncio.create_task(ticker())
        try:
            assert await m.beat() is False
            # The loop kept running while the heartbeat waited for the database.
            assert ticks > 3
            assert count(registry, "failed") == 1
            # The abandoned call is still out (the driver's connect timeout is longer): the
            # next beat is skipped, not queued behind it.
            assert await m.beat() is False
            assert count(registry, "skipped") == 1
            try:
                await m.live()
                raise AssertionError("live() answered without a database")
            except MembershipUnavailable as e:
                assert e.status_code == 503 and "did not answer" in e.message
            await m.stop()  # its delete times out too; stopping still completes
        finally:
            ticking.cancel()
    assert m.peers == [] and count(registry, "ok") == 0


async def test_heartbeats_fail_while_the_database_is_locked_and_recover(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'hub.db'}"
    upgrade(url)
    registry = CollectorRegistry()
    m = membership(url, registry, 0.3)
    assert await m.beat() is True
    assert [p.id for p in m.peers] == ["me"]

    blocker = sqlite3.connect(tmp_path / "hub.db", isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # another writer holds the database
    await m.start()  # the first beat fails; the timer keeps trying
    await eventually(lambda: count(registry, "failed") >= 2)
    ok_before = count(registry, "ok")
    blocker.execute("ROLLBACK")
    blocker.close()
    await eventually(lambda: count(registry, "ok") > ok_before)
    assert [p.id for p in m.peers] == ["me"]
    await m.stop()
    book = ReplicaBook(url, timeout=1)
    assert book.live(5) == []
    book.dispose()


def test_replica_settings_are_checked() -> None:
    with pytest.raises(ValidationError, match=r"must exceed replica\.heartbeat_interval"):
        ReplicaSettings(heartbeat_interval="10s", expire_after="5s")
    with pytest.raises(ValidationError, match="is not a base URL"):
        ReplicaSettings(advertise_url="10.0.0.7:8000")
    s = HubSettings(replica={"advertise_url": "http://10.0.0.7:8000/", "id": "pod-a"})
    assert s.replica.advertise_url == "http://10.0.0.7:8000" and s.replica.id == "pod-a"


def test_advertised_address_names_a_reachable_host() -> None:
    from hub.replicas import advertise_url

    assert advertise_url(HubSettings(host="127.0.0.1", port=9000)) == "http://127.0.0.1:9000"
    wildcard = HubSettings(host="0.0.0.0", port=9000)
    assert advertise_url(wildcard) == f"http://{socket.gethostname()}:9000"
    assert advertise_url(HubSettings(host="::1", port=9000)) == "http://[::1]:9000"
    explicit = HubSettings(host="0.0.0.0", replica={"advertise_url": "http://10.1.2.3:8000"})
    assert advertise_url(explicit) == "http://10.1.2.3:8000"
