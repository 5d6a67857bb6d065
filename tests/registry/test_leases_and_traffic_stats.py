"""Canary leases and shared traffic rows on SQLite: one holder at a time, takeover only after
expiry; flushed rows add up across processes, a repeated flush never double-counts, and a
split change starts a new window."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from sqlalchemy import Engine

from registry.db import Database, upgrade
from registry.leases import LeaseBook
from registry.replicas import membership_engine
from registry.schema import RegisteredModel
from registry.traffic_stats import TrafficStatsBook, VersionTraffic

TTL = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = dt.datetime(2026, 11, 25, 12, 0, tzinfo=dt.UTC)

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    url = f"sqlite:///{tmp_path / 'hub.db'}"
    upgrade(url)
    with Database(url).session() as s:
        s.add(RegisteredModel(name="emb", kind="embedder"))
    return membership_engine(url, timeout=2)


def test_one_holder_at_a_time_and_a_takeover_only_after_expiry(engine: Engine) -> None:
    clock = Clock()
    leases = LeaseBook(engine, clock=clock)
    assert leases.acquire("canary:emb", "a", TTL)
    assert not leases.acquire("canary:emb", "b", TTL)  # a holds it
    clock.advance(TTL - 1)
    assert leases.acquire("canary:emb", "a", TTL)  # a renews before it expires...
    clock.advance(TTL - 1)
    assert not leases.acquire("canary:emb", "b", TTL)  # ...so b still waits
    clock.advance(2)  # a died: no renewal, the lease expires
    assert leases.acquire("canary:emb", "b", TTL)
    assert not leases.acquire("canary:emb", "a", TTL)  # a is back, but b holds it now
    assert leases.holder("canary:emb") == ("b", clock.now + dt.timedelta(seconds=TTL))
    leases.release("canary:emb", "a")  # not a's to release
    assert not leases.acquire("canary:emb", "a", TTL)
    leases.release("canary:emb", "b")  # a clean shutdown hands it over at once
    assert leases.acquire("canary:emb", "a", TTL)
    assert leases.acquire("canary:other", "b", TTL)  # leases are per name


def traffic(label: str, revision: int, requests: int, replica: str) -> VersionTraffic:
    return VersionTraffic(
        model="emb", label=label, revision=revision, requests=requests, routed=requests,
        errors=1, tokens=10 * requests, busy_s=0.01 * requests, latency={"40": requests - 1},
        replica=replica,
    )  # fmt: skip


def test_flushed_rows_add_up_and_a_repeated_flush_overwrites(engine: Engine) -> None:
    book = TrafficStatsBook(engine, retention=dt.timedelta(days=1))
    assert book.flush("r1", "inc-1", [traffic("1", 0, 5, "r1")]) == 1
    # Cumulative: a repeated or later flush rewrites the row, it never adds to it.
    book.flush("r1", "inc-1", [traffic("1", 0, 8, "r1")])
    book.flush("r1", "inc-1", [traffic("1", 0, 8, "r1")])
    book.flush("r2", "inc-2", [traffic("1", 0, 3, "r2"), traffic("2", 0, 4, "r2")])
    read = book.read("emb", revisions=1, exclude_incarnation="inc-3")
    assert read.revision == 0
    by = {(r.replica, r.label): r for r in read.rows}
    assert {k: r.requests for k, r in by.items()} == {("r1", "1"): 8, ("r2", "1"): 3,
                                                      ("r2", "2"): 4}  # fmt: skip
    assert by[("r1", "1")].latency == {"40": 7}
    # A process reads others' rows only; its own numbers are fresher in its memory.
    mine = book.read("emb", revisions=1, exclude_incarnation="inc-1")
    assert {r.replica for r in mine.rows} == {"r2"}
    # Rows of an older policy revision are outside the current window.
    book.flush("r1", "inc-1", [traffic("1", -1, 50, "r1")])
    assert (
        sum(r.requests for r in book.read("emb", revisions=1, exclude_incarnation="x").rows) == 15
    )
    assert (
        sum(r.requests for r in book.read("emb", revisions=2, exclude_incarnation="x").rows) == 65
    )
