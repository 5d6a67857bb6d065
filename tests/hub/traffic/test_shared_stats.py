"""Flushing traffic statistics: a database that refuses writes only delays them (nothing is
lost, nothing is counted twice), and the event loop keeps running meanwhile."""

from __future__ import annotations

import asyncio
import datetime as dt
import sqlite3
from pathlib import Path

from prometheus_client import CollectorRegistry
from sqlalchemy import Engine

from hub.sql_worker import SqlWorker
from hub.traffic.metrics import TrafficMetrics
from hub.traffic.shared import SharedStats
from hub.traffic.stats import KEPT_REVISIONS, TrafficStats
from registry.db import Database, upgrade
from registry.replicas import membership_engine
from registry.schema import RegisteredModel
from registry.traffic_stats import TrafficStatsBook


def record(stats: TrafficStats, n: int) -> None:
    for _ in range(n):
        stats.record("emb", "1", revision=0, latency_s=0.01, error=False, routed=True, tokens=3)


def stats_book(path: Path, timeout: float) -> tuple[Engine, TrafficStatsBook]:
    """A migrated SQLite database at `path` with model "emb", and its statistics book on an
    engine that gives up after `timeout` seconds."""
    url = f"sqlite:///{path}"
    upgrade(url)
    with Database(url).session() as s:
        s.add(RegisteredModel(name="emb", kind="embedder"))
    engine = membership_engine(url, timeout=timeout)
    return engine, TrafficStatsBook(engine, retention=dt.timedelta(days=1))


async def test_an_outage_only_delays_flushes(tmp_path: Path) -> None:
    path = tmp_path / "hub.db"
    engine, book = stats_book(path, timeout=0.3)
    registry = CollectorRegistry()
    stats = TrafficStats(100)
    shared = SharedStats(stats, book, TrafficMetrics(registry), replica="r1", interval=60,
                         sql=SqlWorker(1.0, name="test-sql"))  # fmt: skip

    def flushes(outcome: str) -> float:
        value = registry.get_sample_value("hub_traffic_stats_flushes_total", {"outcome": outcome})
        return value or 0.0

    def flushed() -> int:
        read = book.read("emb", revisions=1, exclude_incarnation="another process")
        return sum(row.requests for row in read.rows)

    record(stats, 5)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # another writer holds the database: writes fail
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticking = asyncio.create_task(ticker())
    try:
        assert await shared.flush() is False
        assert ticks > 3  # the loop ran while the flush waited
    finally:
        ticking.cancel()
    assert flushes("failed") == 1
    record(stats, 2)  # traffic goes on during the outage
    blocker.execute("ROLLBACK")
    blocker.close()

    assert await shared.flush() is True
    assert flushed() == 7  # the failed flush's numbers came with the next one
    assert await shared.flush() is True  # nothing changed: nothing written twice
    assert flushed() == 7 and flushes("ok") == 1
    totals = await shared.totals("emb", revisions=1, local_revision=0)
    assert totals.arm("1").requests == 7 and totals.replicas == ["r1"] and totals.shared
    shared.sql.shutdown()
    engine.dispose()


def test_old_revisions_are_forgotten_once_flushed() -> None:
    stats = TrafficStats(100)
    stats.record("emb", "1", revision=1, latency_s=0.01, error=False, routed=True, tokens=0)
    stats.changed()  # flushed
    stats.record("emb", "1", revision=2, latency_s=0.01, error=False, routed=True, tokens=0)
    far = 2 + KEPT_REVISIONS
    stats.record("emb", "1", revision=far, latency_s=0.01, error=False, routed=True, tokens=0)
    # Revision 1 was flushed and is out of reach; revision 2 still waits for its flush.
    assert set(stats.tallies("emb", range(0, far + 1))) == {("1", 2), ("1", far)}


async def test_a_clean_stop_writes_what_came_during_a_slow_flush(tmp_path: Path) -> None:
    path = tmp_path / "hub.db"
    engine, book = stats_book(path, timeout=10.0)  # a slow database, not a dead one
    stats = TrafficStats(100)
    shared = SharedStats(stats, book, TrafficMetrics(CollectorRegistry()), replica="r1",
                         interval=0.01, sql=SqlWorker(20.0, name="test-sql"))  # fmt: skip
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # the flush loop's write waits behind this writer
    record(stats, 5)
    shared.start()
    for _ in range(500):  # until the loop's first flush is under way
        if shared._pending is not None:
            break
        await asyncio.sleep(0.01)
    record(stats, 2)  # counted while that flush waits; stop() must write it too

    def unblock() -> None:
        blocker.execute("ROLLBACK")
        blocker.close()

    asyncio.get_running_loop().call_later(0.3, unblock)
    await shared.stop()
    read = book.read("emb", revisions=1, exclude_incarnation="another process")
    assert sum(row.requests for row in read.rows) == 7
    shared.sql.shutdown()
    engine.dispose()
