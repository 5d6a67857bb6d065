"""Rate limits shared by replicas through SQL (SQLite here; PostgreSQL in
tests/hub/replicas/test_rate_limits.py): each replica admits against the fleet's consumption
as of its last sync plus its own since, a dead replica's consumption keeps counting until
its slots pass, and a database that fails leaves each replica limiting on what it knows."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import func, select

from hub.rate_limits.limiter import RateLimited, RateLimiter
from hub.rate_limits.sync import LimitSync
from hub.sql_worker import SqlWorker
from registry.db import upgrade
from registry.keys import KeyLimits, ModelLimits
from registry.rate_limits import RateLimitBook
from registry.replicas import membership_engine
from registry.schema import RateLimitSpendRow

START = 1_800_000_000.0  # a wall-clock time, on a slot boundary
PER_MINUTE = KeyLimits(requests_per_minute=60)


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


def replica(
    url: str,
    clock: Callable[[], float],
    name: str,
    metrics: CollectorRegistry | None = None,
    interval: float = 0.5,
) -> LimitSync:
    limiter = RateLimiter(clock)
    book = RateLimitBook(membership_engine(url, 2.0))
    sql = SqlWorker(2.0, name=f"limits-{name}")
    return LimitSync(limiter, book, replica=name, interval=interval, sql=sql,
                     metrics=metrics or CollectorRegistry())  # fmt: skip


def admitted(
    sync: LimitSync, count: int, limits: KeyLimits = PER_MINUTE, model: str | None = None
) -> int:
    """How many of `count` requests of key "team" (for `model`) the replica admits (each
    settled)."""
    n = 0
    models = (model,) if model is not None else ()
    for _ in range(count):
        try:
            sync.limiter.settle(sync.limiter.admit("team", limits, 1, None, models))
        except RateLimited:
            continue
        n += 1
    return n


def minute_rows(book: RateLimitBook) -> int:
    row = RateLimitSpendRow
    with book.engine.connect() as conn:
        return int(conn.scalar(select(func.count()).where(row.span == 1)) or 0)


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'hub.db'}"
    upgrade(url)
    return url


async def test_two_replicas_admit_one_limit_between_them(url: str) -> None:
    clock = Clock()
    a, b = replica(url, clock, "a"), replica(url, clock, "b")
    assert admitted(a, 40) == 40
    # Before any sync b knows only its own consumption.
    assert b.limiter.status("team", PER_MINUTE)["x-ratelimit-remaining-requests"] == "60"
    assert await a.write() and await b.read()
    status = b.limiter.status("team", PER_MINUTE)
    assert status["x-ratelimit-remaining-requests"] == "20"
    assert admitted(b, 30) == 20
    with pytest.raises(RateLimited) as refused:
        b.limiter.admit("team", PER_MINUTE, 1, None)
    headers = refused.value.headers
    assert refused.value.status_code == 429
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["Retry-After"] == "1"  # one request's worth refills each second
    # a still admits until it hears of b's 20; then the fleet is at the limit.
    assert await b.write() and await a.read()
    assert admitted(a, 5) == 0
    # Two seconds later the fleet's bucket refilled two requests, for whichever replica.
    clock.now += 2
    assert admitted(a, 1) == 1
    assert await a.write() and await b.read()
    assert admitted(b, 2) == 1
    for sync in (a, b):
        await sync.stop()
        sync.close()


async def test_a_limit_on_one_model_is_summed_over_the_replicas(url: str) -> None:
    clock = Clock()
    a, b = replica(url, clock, "a"), replica(url, clock, "b")
    limits = KeyLimits(
        requests_per_minute=100, models={"chat": ModelLimits(requests_per_minute=10)}
    )
    assert admitted(a, 6, limits, "chat") == 6
    assert await a.write() and await b.read()
    assert admitted(b, 8, limits, "chat") == 4
    with pytest.raises(RateLimited, match="requests_per_minute for model chat"):
        b.limiter.admit("team", limits, 1, None, ("chat",))
    # The key's other models still have the rest of its own limit, on either replica.
    assert admitted(b, 5, limits, "emb") == 5
    assert await b.write() and await a.read()
    assert admitted(a, 3, limits, "chat") == 0
    status = a.limiter.status("team", limits, ("emb",))
    assert status["x-ratelimit-remaining-requests"] == str(100 - 6 - 4 - 5)
    for sync in (a, b):
        await sync.stop()
        sync.close()


async def test_a_dead_replica_counts_until_its_slots_pass(url: str) -> None:
    clock = Clock()
    dead = replica(url, clock, "a")
    assert admitted(dead, 50) == 50
    assert await dead.write()  # then killed: never stopped, its rows stay
    # The same pod restarted: a new process, a new incarnation, the old rows still count.
    restarted = replica(url, clock, "a")
    assert await restarted.read()
    assert admitted(restarted, 20) == 10
    assert await restarted.write()
    assert minute_rows(restarted.book) == 2
    # A minute on, the dead process's slot is out of the window, and its row deleted.
    clock.now += 62
    assert admitted(restarted, 1) == 1 and await restarted.write()
    assert minute_rows(restarted.book) == 1
    assert await restarted.read()
    assert restarted.limiter.status("team", PER_MINUTE)["x-ratelimit-remaining-requests"] == "59"
    dead.close()
    await restarted.stop()
    restarted.close()


async def test_tokens_streamed_on_one_replica_count_on_the_other(url: str) -> None:
    clock = Clock()
    a, b = replica(url, clock, "a"), replica(url, clock, "b")
    limits = KeyLimits(tokens_per_minute=1000, tokens_per_day=5000)
    admission = a.limiter.admit("team", limits, 1, b'{"model": "m", "max_tokens": 600}')
    assert admission.reserved > 600
    assert await a.write() and await b.read()
    # The reservation counts on b while the answer is still under way...
    with pytest.raises(RateLimited, match="1000 tokens per minute"):
        b.limiter.admit("team", limits, 1, b'{"model": "m", "max_tokens": 500}')
    # ...and once it settled on what it used, so does the refund.
    admission.usage = 100
    a.limiter.settle(admission)
    assert await a.write() and await b.read()
    remaining = b.limiter.status("team", limits)["x-ratelimit-remaining-tokens"]
    assert remaining == "900"
    b.limiter.admit("team", limits, 1, b'{"model": "m", "max_tokens": 500}')
    for sync in (a, b):
        sync.close()


async def test_a_failing_database_leaves_each_replica_limiting_on_what_it_knows(
    url: str, tmp_path: Path
) -> None:
    clock = Clock()
    a = replica(url, clock, "a")
    assert admitted(a, 30) == 30
    # The database stops answering (here: a file without the table).
    metrics = CollectorRegistry()
    broken = replica(f"sqlite:///{tmp_path / 'empty.db'}", clock, "b", metrics)
    broken.limiter = a.limiter
    assert await broken.write() is False and await broken.read() is False
    for step in ("write", "read"):
        labels = {"step": step, "outcome": "failed"}
        assert metrics.get_sample_value("hub_rate_limit_syncs_total", labels) == 1
    # No request fails for it: the replica still holds the limit on its own consumption.
    assert admitted(a, 40) == 30
    # What failed to be written is written once the database answers again.
    assert await a.write()
    other = replica(url, clock, "c")
    assert await other.read()
    assert other.limiter.status("team", PER_MINUTE)["x-ratelimit-remaining-requests"] == "0"
    for sync in (a, broken, other):
        sync.close()


def others(sync: LimitSync) -> int:
    """The requests of key "team" the replica knows the other replicas admitted."""
    spend = sync.limiter.ledger.keys.get("team")
    return sum(c[0] for c in spend.minute.others.values()) if spend is not None else 0


async def test_the_background_sync_shares_consumption_and_writes_at_stop(url: str) -> None:
    a = replica(url, time.time, "a", interval=0.1)
    b = replica(url, time.time, "b", interval=0.1)
    a.start()
    b.start()
    assert admitted(a, 10) == 10
    for _ in range(400):  # a hang guard, not a timing claim
        if others(b) == 10:
            break
        await asyncio.sleep(0.05)
    assert others(b) == 10
    await b.stop()
    assert admitted(a, 5) == 5
    await a.stop()  # its last write: the 5 admitted just before are in SQL
    later = replica(url, time.time, "c")
    assert await later.read()
    assert others(later) == 15
    for sync in (a, b, later):
        sync.close()
