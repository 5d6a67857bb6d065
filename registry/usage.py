"""Metered usage in SQL (`hub_usage`): per caller, model version and UTC hour, what every
replica answered, and the totals the admin API reads.

Replicas write increments, never totals: `add` upserts each row as `x = x + excluded.x`
(PostgreSQL's and SQLite's `ON CONFLICT ... DO UPDATE`), so any number of replicas add to
the same rows without reading them first, and one batch is one transaction: its increments
all land or none do.

Blocking, on an engine with short timeouts (`registry.replicas.membership_engine`): callers
on an event loop run it in a thread.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from sqlalchemy import Engine, event, func, select
from sqlalchemy.dialects import postgresql, sqlite

from registry.replicas import membership_engine
from registry.schema import UsageRow

# What usage can be grouped by; `key` is the caller (the API key's name).
DIMENSIONS = ("key", "model", "version", "hour")
_COLUMNS = {"key": UsageRow.key_name, "model": UsageRow.model, "version": UsageRow.version,
            "hour": UsageRow.hour}  # fmt: skip


@dataclass(slots=True)
class UsageCounts:
    """Counts of one request, or the sum of many (see `UsageRow` for what each means)."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    embedded_inputs: int = 0
    embedded_tokens: int = 0
    rerank_documents: int = 0

    def add(self, other: UsageCounts) -> None:
        for name in COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COUNTERS}


# The counted quantities, in the order rows and answers list them.
COUNTERS = tuple(f.name for f in fields(UsageCounts))


@dataclass(frozen=True, slots=True)
class UsageKey:
    """The row a request's counts are added to: caller, model, version and UTC hour."""

    key: str
    model: str
    version: int
    hour: dt.datetime


def hour_of(moment: dt.datetime) -> dt.datetime:
    """The start of `moment`'s hour, in UTC (a naive `moment` is taken as UTC)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.astimezone(dt.UTC).replace(minute=0, second=0, microsecond=0)


@dataclass(frozen=True)
class UsageQuery:
    """Which usage to sum and how: rows of caller `key` and `model` (None: all) in the hours
    from `since`'s (inclusive) to `until` (exclusive), grouped by `group_by` (of
    `DIMENSIONS`; empty: one grand total)."""

    key: str | None = None
    model: str | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    group_by: Sequence[str] = ("key", "model", "version")


@dataclass(frozen=True)
class UsageTotal:
    """One row of an answer: the dimensions grouped by (the others None) and the sums."""

    key: str | None
    model: str | None
    version: int | None
    hour: dt.datetime | None
    counts: UsageCounts = field(default_factory=UsageCounts)


def usage_engine(url: str, timeout: float) -> Engine:
    """An engine for usage writes whose every call gives up after about `timeout` seconds.
    On SQLite its commits skip the fsync (`synchronous=NORMAL` in WAL mode): a committed
    batch still survives the process being killed, only not the machine losing power."""
    engine = membership_engine(url, timeout)
    if engine.dialect.name == "sqlite":

        def _no_fsync(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.execute("PRAGMA synchronous=NORMAL")

        event.listen(engine, "connect", _no_fsync)
    return engine


class UsageBook:
    """`hub_usage`; every method is one short transaction. Blocking."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def add(self, increments: Mapping[UsageKey, UsageCounts]) -> None:
        """Add every increment to its row (created at zero when missing), in one transaction."""
        if not increments:
            return
        # One entry per row (PostgreSQL refuses a statement that updates a row twice), in one
        # order for every writer: two replicas' batches that touch the same rows lock them in
        # the same order, so they wait for each other and never deadlock.
        rows: dict[tuple[str, str, int, dt.datetime], UsageCounts] = {}
        for k, c in increments.items():
            rows.setdefault((k.key, k.model, k.version, hour_of(k.hour)), UsageCounts()).add(c)
        values = [
            {"key_name": key, "model": model, "version": version, "hour": hour, **c.as_dict()}
            for (key, model, version, hour), c in sorted(rows.items(), key=lambda kc: kc[0])
        ]
        dialect = self.engine.dialect.name
        insert: Any
        if dialect == "postgresql":
            insert = postgresql.insert(UsageRow)
        elif dialect == "sqlite":
            insert = sqlite.insert(UsageRow)
        else:
            raise NotImplementedError(f"usage metering needs PostgreSQL or SQLite, not {dialect}")
        table = UsageRow.__table__
        upsert = insert.on_conflict_do_update(
            index_elements=["key_name", "model", "version", "hour"],
            set_={name: table.c[name] + insert.excluded[name] for name in COUNTERS},
        )
        with self.engine.begin() as conn:
            conn.execute(upsert, values)

    def totals(self, query: UsageQuery) -> list[UsageTotal]:
        """The sums `query` asks for, ordered by its dimensions."""
        unknown = [d for d in query.group_by if d not in DIMENSIONS]
        if unknown:
            raise ValueError(f"cannot group usage by {', '.join(unknown)}")
        dims = [d for d in DIMENSIONS if d in query.group_by]
        columns = [_COLUMNS[d] for d in dims]
        sums = [func.coalesce(func.sum(getattr(UsageRow, c)), 0) for c in COUNTERS]
        statement = select(*columns, *sums)
        if query.key is not None:
            statement = statement.where(UsageRow.key_name == query.key)
        if query.model is not None:
            statement = statement.where(UsageRow.model == query.model)
        if query.since is not None:
            statement = statement.where(UsageRow.hour >= hour_of(query.since))
        if query.until is not None:
            statement = statement.where(UsageRow.hour < _aware(query.until))
        if columns:
            statement = statement.group_by(*columns).order_by(*columns)
        with self.engine.connect() as conn:
            rows = conn.execute(statement).all()
        out = []
        for row in rows:
            grouped: dict[str, Any] = dict(zip(dims, row[: len(dims)], strict=True))
            counts = UsageCounts(*(int(v) for v in tuple(row)[len(dims) :]))
            if not columns and counts.requests == 0:
                continue  # no usage at all: no grand-total row
            hour = grouped.get("hour")
            out.append(
                UsageTotal(
                    key=grouped.get("key"),
                    model=grouped.get("model"),
                    version=grouped.get("version"),
                    hour=hour_of(hour) if hour is not None else None,
                    counts=counts,
                )
            )
        return out


def _aware(moment: dt.datetime) -> dt.datetime:
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)
    return aware.astimezone(dt.UTC)
