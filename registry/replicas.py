"""Replica membership in SQL: one heartbeat row per hub process sharing the database.

Each replica rewrites its row every few seconds (`beat`) and deletes it on a clean shutdown
(`leave`); a row whose `last_seen` is older than the expiry belongs to a replica that died
and is no longer listed (`live`), and long-dead rows are deleted by the next beat.

The book has an engine of its own with short timeouts (connect, statement, lock, TCP): a
heartbeat against an unreachable database fails within `timeout` seconds instead of hanging,
and the hub's main connection pool, however busy, never delays a heartbeat. Time is the
database's clock on PostgreSQL, so replicas on different machines compare against one clock;
this process's clock on SQLite (one machine). A `clock` may be injected (tests).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, create_engine, delete, event, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from registry.db import sqlite_path
from registry.schema import Replica

# Rows of replicas dead for this many expiry periods are deleted (kept a while before that,
# so an operator looking at the table sees what went away).
PRUNE_AFTER_EXPIRIES = 20


@dataclass(frozen=True)
class ReplicaBeat:
    """What a replica reports about itself in one heartbeat."""

    id: str
    address: str
    hub_version: str
    # [{name, version, kind, state, device, bytes, pinned, in_flight}]
    models: list[dict[str, Any]]
    # [{name, budget_bytes, free_bytes}]
    devices: list[dict[str, Any]]
    host_free_bytes: int
    queue_depth: int


@dataclass(frozen=True)
class ReplicaView:
    """A live replica as the table shows it; `seen_s_ago` by the book's clock."""

    id: str
    address: str
    hub_version: str
    started_at: dt.datetime
    last_seen: dt.datetime
    seen_s_ago: float
    models: list[dict[str, Any]]
    devices: list[dict[str, Any]]
    host_free_bytes: int
    queue_depth: int


def _utc(value: dt.datetime) -> dt.datetime:
    # SQLite hands datetimes back without their zone; they were written in UTC.
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)


def _view(row: Replica, now: dt.datetime) -> ReplicaView:
    last_seen = _utc(row.last_seen)
    return ReplicaView(
        id=row.id,
        address=row.address,
        hub_version=row.hub_version,
        started_at=_utc(row.started_at),
        last_seen=last_seen,
        seen_s_ago=round(max(0.0, (now - last_seen).total_seconds()), 3),
        models=list(row.models or []),
        devices=list(row.devices or []),
        host_free_bytes=row.host_free_bytes,
        queue_depth=row.queue_depth,
    )


def membership_engine(url: str, timeout: float) -> Engine:
    """An engine whose every call gives up after about `timeout` seconds."""
    ms = max(1, int(timeout * 1000))
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        path = sqlite_path(url)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": timeout})

        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute(f"PRAGMA busy_timeout={ms}")
            cursor.close()

        event.listen(engine, "connect", _pragmas)
        return engine
    connect_args: dict[str, Any] = {}
    if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() in (
        "psycopg",
        "psycopg2",
    ):
        seconds = max(1, math.ceil(timeout))
        connect_args = {
            "connect_timeout": seconds,
            # The server ends a statement or lock wait that runs too long...
            "options": f"-c statement_timeout={ms} -c lock_timeout={ms}",
            # ...and the client gives up on a peer that stopped answering (no RST: a
            # partition), where a plain socket read would wait for minutes.
            "tcp_user_timeout": ms,
            "keepalives": 1,
            "keepalives_idle": seconds,
            "keepalives_interval": 1,
            "keepalives_count": 2,
        }
    return create_engine(
        url,
        pool_size=2,
        max_overflow=0,
        pool_timeout=timeout,
        pool_pre_ping=True,
        connect_args=connect_args,
    )


class ReplicaBook:
    """Heartbeat rows in `hub_replicas`; every method is one short transaction. Blocking:
    callers on an event loop run it in a thread."""

    def __init__(
        self, url: str, *, timeout: float, clock: Callable[[], dt.datetime] | None = None
    ) -> None:
        self.engine = membership_engine(url, timeout)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._clock = clock

    def _now(self, s: Session) -> dt.datetime:
        if self._clock is not None:
            return self._clock()
        if self.engine.dialect.name == "postgresql":
            return _utc(s.execute(select(func.now())).scalar_one())
        return dt.datetime.now(dt.UTC)

    def beat(self, beat: ReplicaBeat, *, restarted: bool, expire_after: float) -> list[ReplicaView]:
        """Write this replica's row (a fresh `started_at` when `restarted`: this process's
        first beat), delete rows dead for long, and return the live replicas, this one
        included, in one transaction."""
        with self._sessions() as s, s.begin():
            now = self._now(s)
            row = s.get(Replica, beat.id)
            if row is None:
                row = Replica(id=beat.id, started_at=now)
                s.add(row)
            elif restarted:
                row.started_at = now
            row.address = beat.address
            row.hub_version = beat.hub_version
            row.last_seen = now
            row.models = beat.models
            row.devices = beat.devices
            row.host_free_bytes = beat.host_free_bytes
            row.queue_depth = beat.queue_depth
            s.flush()
            dead = now - dt.timedelta(seconds=expire_after * PRUNE_AFTER_EXPIRIES)
            s.execute(delete(Replica).where(Replica.last_seen < dead))
            return self._live(s, now, expire_after)

    def live(self, expire_after: float) -> list[ReplicaView]:
        """Replicas whose last heartbeat is at most `expire_after` seconds old, by id."""
        with self._sessions() as s, s.begin():
            return self._live(s, self._now(s), expire_after)

    def leave(self, replica_id: str) -> None:
        """Delete a replica's row (a clean shutdown): peers stop listing it at once."""
        with self._sessions() as s, s.begin():
            s.execute(delete(Replica).where(Replica.id == replica_id))

    def dispose(self) -> None:
        self.engine.dispose()

    def _live(self, s: Session, now: dt.datetime, expire_after: float) -> list[ReplicaView]:
        cutoff = now - dt.timedelta(seconds=expire_after)
        rows = s.scalars(
            select(Replica).where(Replica.last_seen >= cutoff).order_by(Replica.id)
        ).all()
        return [_view(row, now) for row in rows]
