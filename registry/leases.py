"""Named leases in SQL (`hub_leases`): at most one holder at a time, until it expires.

`acquire` takes a lease that is free, expired or already ours (then it renews it) in one
compare-and-set statement, so two replicas racing for it cannot both win; a replica that dies
stops renewing, and the lease is free for another once `expires_at` has passed. Time is the
database's clock on PostgreSQL (replicas on different machines compare against one clock),
this process's clock on SQLite (one machine); a `clock` may be injected (tests).

Blocking, on an engine with short timeouts (`registry.replicas.membership_engine`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any, cast

from sqlalchemy import CursorResult, Engine, case, delete, exc, func, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from registry.schema import Lease


class LeaseBook:
    """Acquire, renew and release named leases; every method is one short transaction."""

    def __init__(self, engine: Engine, *, clock: Callable[[], dt.datetime] | None = None) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._clock = clock

    def _now(self, s: Session) -> dt.datetime:
        if self._clock is not None:
            return self._clock()
        if self.engine.dialect.name == "postgresql":
            now: dt.datetime = s.execute(select(func.now())).scalar_one()
            return now
        return dt.datetime.now(dt.UTC)

    def acquire(self, name: str, holder: str, ttl_s: float) -> bool:
        """Take or renew lease `name` for `ttl_s` seconds; False when another holds it."""
        with self._sessions() as s, s.begin():
            now = self._now(s)
            until = now + dt.timedelta(seconds=ttl_s)
            taken = update(Lease).where(
                Lease.name == name,
                or_(Lease.holder == holder, Lease.expires_at <= now),
            )
            result = s.execute(
                taken.values(
                    holder=holder,
                    expires_at=until,
                    # A takeover starts a new tenure; a renewal keeps its start.
                    acquired_at=case((Lease.holder == holder, Lease.acquired_at), else_=now),
                )
            )
            if cast(CursorResult[Any], result).rowcount == 1:
                return True
            if s.get(Lease, name) is not None:
                return False  # held by someone else, not expired
        try:
            with self._sessions() as s, s.begin():
                s.add(Lease(name=name, holder=holder, expires_at=until, acquired_at=now))
            return True
        except exc.IntegrityError:  # another replica inserted it first
            return False

    def release(self, name: str, holder: str) -> None:
        """Give the lease up now (when we hold it), so another may take it at once."""
        with self._sessions() as s, s.begin():
            s.execute(delete(Lease).where(Lease.name == name, Lease.holder == holder))

    def holder(self, name: str) -> tuple[str, dt.datetime] | None:
        """(holder, expires_at) of lease `name`, None when nobody holds it."""
        with self._sessions() as s, s.begin():
            row = s.get(Lease, name)
            if row is None:
                return None
            expires = row.expires_at
            if expires.tzinfo is None:  # SQLite hands datetimes back without their zone
                expires = expires.replace(tzinfo=dt.UTC)
            return row.holder, expires
