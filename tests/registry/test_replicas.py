"""Heartbeat rows: a replica is listed while its beats are fresh, drops out after the expiry,
leaves at once on a clean shutdown, and long-dead rows are deleted."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from sqlalchemy import select

from registry.db import Database, upgrade
from registry.replicas import PRUNE_AFTER_EXPIRIES, ReplicaBeat, ReplicaBook
from registry.schema import Replica

EXPIRE = 15.0


class Clock:
    def __init__(self) -> None:
        self.now = dt.datetime(2026, 11, 23, 12, 0, tzinfo=dt.UTC)

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)


def beat(rid: str, queue: int = 0) -> ReplicaBeat:
    return ReplicaBeat(
        id=rid,
        address=f"http://{rid}:8000",
        hub_version="0.1.0",
        models=[{"name": "emb", "version": 1, "kind": "embedder", "state": "loaded",
                 "device": "cpu", "bytes": 1000, "pinned": False, "in_flight": queue}],
        devices=[{"name": "cpu", "budget_bytes": 4000, "free_bytes": 3000}],
        host_free_bytes=500,
        queue_depth=queue,
    )  # fmt: skip


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'hub.db'}"
    upgrade(url)
    return url


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def book(url: str, clock: Clock) -> ReplicaBook:
    return ReplicaBook(url, timeout=2, clock=clock)


def test_fresh_beats_are_listed_with_what_they_report(book: ReplicaBook, clock: Clock) -> None:
    book.beat(beat("a"), restarted=True, expire_after=EXPIRE)
    clock.advance(2)
    live = book.beat(beat("b", queue=3), restarted=True, expire_after=EXPIRE)
    assert [r.id for r in live] == ["a", "b"]
    a, b = live
    assert a.seen_s_ago == 2 and b.seen_s_ago == 0
    assert b.address == "http://b:8000" and b.queue_depth == 3
    assert b.models[0]["name"] == "emb" and b.devices[0]["free_bytes"] == 3000
    assert b.host_free_bytes == 500
    assert b.last_seen.tzinfo is not None


def test_a_silent_replica_drops_out_after_the_expiry(book: ReplicaBook, clock: Clock) -> None:
    book.beat(beat("a"), restarted=True, expire_after=EXPIRE)
    book.beat(beat("b"), restarted=True, expire_after=EXPIRE)
    for _ in range(3):  # a keeps beating, b died
        clock.advance(EXPIRE / 3)
        book.beat(beat("a"), restarted=False, expire_after=EXPIRE)
    assert [r.id for r in book.live(EXPIRE)] == ["a", "b"]  # exactly at the expiry: still in
    clock.advance(1)
    assert [r.id for r in book.live(EXPIRE)] == ["a"]


def test_a_clean_shutdown_leaves_at_once(book: ReplicaBook) -> None:
    book.beat(beat("a"), restarted=True, expire_after=EXPIRE)
    book.beat(beat("b"), restarted=True, expire_after=EXPIRE)
    book.leave("b")
    assert [r.id for r in book.live(EXPIRE)] == ["a"]


def test_a_restarted_process_takes_its_row_over(book: ReplicaBook, clock: Clock) -> None:
    first = book.beat(beat("a"), restarted=True, expire_after=EXPIRE)[0]
    clock.advance(5)
    same = book.beat(beat("a", queue=1), restarted=False, expire_after=EXPIRE)[0]
    assert same.started_at == first.started_at and same.queue_depth == 1
    clock.advance(5)
    again = book.beat(beat("a"), restarted=True, expire_after=EXPIRE)
    assert len(again) == 1 and again[0].started_at == clock.now


def test_long_dead_rows_are_deleted(url: str, book: ReplicaBook, clock: Clock) -> None:
    book.beat(beat("dead"), restarted=True, expire_after=EXPIRE)
    clock.advance(EXPIRE * PRUNE_AFTER_EXPIRIES - 1)
    book.beat(beat("a"), restarted=True, expire_after=EXPIRE)
    db = Database(url)
    with db.session() as s:
        assert set(s.scalars(select(Replica.id))) == {"dead", "a"}  # expired, kept a while
    clock.advance(2)
    book.beat(beat("a"), restarted=False, expire_after=EXPIRE)
    with db.session() as s:
        assert set(s.scalars(select(Replica.id))) == {"a"}
    db.dispose()


def test_wall_clock_rows_expire_too(url: str) -> None:
    """Without an injected clock (SQLite: this process's UTC clock) a fresh beat is live."""
    book = ReplicaBook(url, timeout=2)
    live = book.beat(beat("a"), restarted=True, expire_after=EXPIRE)
    assert [r.id for r in live] == ["a"] and 0 <= live[0].seen_s_ago < EXPIRE
    book.dispose()
