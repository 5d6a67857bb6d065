"""The usage meter's group commit on SQLite: a request returns once its usage is in SQL;
requests that finish while a write is under way go together in the next one; a database that
fails or stalls neither holds answers for long nor loses or double-counts usage."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine

from hub.usage.meter import UsageMeter
from hub.usage.metrics import UsageMetrics
from registry.db import upgrade
from registry.replicas import membership_engine
from registry.usage import UsageBook, UsageCounts, UsageKey, UsageQuery

NOON = dt.datetime(2026, 11, 25, 12, 0, tzinfo=dt.UTC)


class FaultyBook(UsageBook):
    """The real book, whose writes can be held (`gate` cleared) or fail (`down`)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.gate = threading.Event()
        self.gate.set()
        self.down = False
        self.batches: list[int] = []
        self.writes_begun = 0

    def add(self, increments: Mapping[UsageKey, UsageCounts]) -> None:
        self.writes_begun += 1
        self.gate.wait(10)
        if self.down:
            raise ConnectionError("the database does not answer")
        super().add(increments)
        self.batches.append(sum(c.requests for c in increments.values()))

    def requests(self) -> int:
        return sum(t.counts.requests for t in self.totals(UsageQuery(group_by=())))


@pytest.fixture
def book(tmp_path: Path) -> FaultyBook:
    url = f"sqlite:///{tmp_path / 'hub.db'}"
    upgrade(url)
    return FaultyBook(membership_engine(url, timeout=2))


@pytest.fixture
async def meter(book: FaultyBook) -> AsyncIterator[UsageMeter]:
    metrics = UsageMetrics(CollectorRegistry())
    m = UsageMeter(book, metrics, commit_timeout=5.0, retry_interval=0.05, sql_timeout=2.0,
                   clock=lambda: NOON)  # fmt: skip
    yield m
    book.gate.set()
    book.down = False
    await m.stop()


def one(prompt: int = 3) -> UsageCounts:
    return UsageCounts(requests=1, prompt_tokens=prompt)


async def until(condition: Callable[[], bool], what: str = "the condition") -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} did not come within 5 s")


async def test_a_request_returns_once_its_usage_is_committed(
    meter: UsageMeter, book: FaultyBook
) -> None:
    await meter.record("k", "m", 1, one())
    assert book.requests() == 1  # durable before the caller goes on to answer
    book.gate.clear()
    first = asyncio.create_task(meter.record("k", "m", 1, one()))
    await until(lambda: book.writes_begun == 2)  # the write of `first` is under way, held
    later = [asyncio.create_task(meter.record(f"k{i % 2}", "m", 1, one())) for i in range(8)]
    await asyncio.sleep(0.05)
    assert not first.done() and not any(t.done() for t in later)
    book.gate.set()
    await asyncio.gather(first, *later)
    # One write for `first`, one for the eight that finished while it ran.
    assert book.batches == [1, 1, 8]
    assert book.requests() == 10


async def test_a_failing_database_keeps_usage_in_memory_and_writes_it_once(
    meter: UsageMeter, book: FaultyBook, caplog: pytest.LogCaptureFixture
) -> None:
    book.down = True
    with caplog.at_level(logging.WARNING, logger="hub.usage.meter"):
        await meter.record("k", "m", 1, one())  # answered after the first failed write
        for _ in range(5):
            await meter.record("k", "m", 1, one())  # answered at once while it fails
        await asyncio.sleep(0.2)  # several retries fail meanwhile
    assert meter.unwritten_requests == 6
    unwritten = meter.metrics.unwritten.collect()[0].samples[0].value
    assert unwritten == 6  # hub_usage_unwritten_requests
    assert len([r for r in caplog.records if "could not be written" in r.message]) == 1
    book.down = False
    await until(lambda: not meter.failing)
    assert book.batches == [6] and meter.unwritten_requests == 0  # one retry wrote them all
    await meter.record("k", "m", 1, one())
    assert book.requests() == 7


async def test_a_stalled_commit_lets_the_answer_go_and_lands_later(
    meter: UsageMeter, book: FaultyBook
) -> None:
    meter.commit_timeout = 0.05
    book.gate.clear()
    await meter.record("k", "m", 1, one())
    assert book.requests() == 0
    waited = meter.metrics.waits_timed_out._value.get()  # type: ignore[attr-defined]
    assert waited == 1
    book.gate.set()
    await until(lambda: book.batches == [1])
    assert book.requests() == 1


async def test_stop_writes_what_is_pending(book: FaultyBook) -> None:
    meter = UsageMeter(book, UsageMetrics(CollectorRegistry()), commit_timeout=5.0,
                       retry_interval=0.05, sql_timeout=2.0, clock=lambda: NOON)  # fmt: skip
    book.gate.clear()
    for _ in range(3):
        await meter.record("k", "m", 1, one(), wait=False)  # a client that left waits for none
    stopping = asyncio.create_task(meter.stop())
    await asyncio.sleep(0.05)
    assert not stopping.done()  # the write under way is waited for
    book.gate.set()
    await stopping
    assert book.requests() == 3
    await meter.record("k", "m", 1, one())  # after the shutdown: counted in metrics only
    assert book.requests() == 3
