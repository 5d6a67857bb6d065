"""`hub_usage` on SQLite: increments from several writers add up in one row per key, model,
version and hour; totals group, filter by key, model and time, and a failed batch adds
nothing. (PostgreSQL's upsert runs in tests/hub/replicas/test_usage.py.)"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from registry.db import upgrade
from registry.replicas import membership_engine
from registry.usage import UsageBook, UsageCounts, UsageKey, UsageQuery

NOON = dt.datetime(2026, 11, 25, 12, 30, tzinfo=dt.UTC)
ONE = dt.datetime(2026, 11, 25, 13, 5, tzinfo=dt.UTC)


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    url = f"sqlite:///{tmp_path / 'hub.db'}"
    upgrade(url)
    return membership_engine(url, timeout=2)


def counts(requests: int = 1, prompt: int = 0, completion: int = 0, **extra: int) -> UsageCounts:
    return UsageCounts(
        requests=requests, prompt_tokens=prompt, completion_tokens=completion, **extra
    )


def test_increments_from_several_writers_add_up(engine: Engine) -> None:
    a, b = UsageBook(engine), UsageBook(engine)
    chat = UsageKey("team-a", "chat", 1, NOON)
    a.add({chat: counts(2, prompt=10, completion=4)})
    b.add(
        {
            chat: counts(1, prompt=5, completion=1, errors=1),
            UsageKey("team-a", "chat", 1, NOON.replace(minute=59)): counts(1, prompt=1),
        }
    )
    a.add(
        {
            UsageKey("team-b", "emb", 2, ONE): counts(
                3, prompt=9, embedded_inputs=3, embedded_tokens=9
            )
        }
    )
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM hub_usage")).scalar() == 2

    rows = a.totals(UsageQuery())
    assert [(r.key, r.model, r.version) for r in rows] == [
        ("team-a", "chat", 1),
        ("team-b", "emb", 2),
    ]
    team_a = rows[0].counts
    assert (team_a.requests, team_a.errors, team_a.prompt_tokens, team_a.completion_tokens) == (
        4,
        1,
        16,
        5,
    )
    assert rows[1].counts.embedded_inputs == 3 and rows[1].hour is None

    [hourly_b] = a.totals(UsageQuery(key="team-b", group_by=("hour",)))
    assert hourly_b.hour == ONE.replace(minute=0) and hourly_b.key is None
    [total] = a.totals(UsageQuery(group_by=()))
    assert total.counts.requests == 7
    # `since` counts from the start of its hour, `until` is exclusive.
    assert [r.model for r in a.totals(UsageQuery(since=ONE))] == ["emb"]
    assert [r.model for r in a.totals(UsageQuery(until=ONE.replace(minute=0)))] == ["chat"]
    assert a.totals(UsageQuery(model="nothing", group_by=())) == []


def test_a_failed_batch_adds_nothing(engine: Engine) -> None:
    book = UsageBook(engine)
    with engine.begin() as conn:  # the database refuses one row of the batch
        conn.execute(
            text(
                "CREATE TRIGGER refuse BEFORE INSERT ON hub_usage "
                "WHEN NEW.model = 'bad' BEGIN SELECT RAISE(ABORT, 'no'); END"
            )
        )
    good, bad = UsageKey("k", "good", 1, NOON), UsageKey("k", "bad", 1, NOON)
    with pytest.raises(Exception, match="no"):
        book.add({good: counts(), bad: counts()})
    assert book.totals(UsageQuery()) == []
