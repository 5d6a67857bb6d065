"""Rate-limit consumption shared through SQL (`hub_rate_limit_spend`): what each hub process
admitted per rate-limited key and time slot, and the fleet's sums that every replica holds
its limits against.

A process writes its own rows only (`write`), keyed by its `incarnation` (unique per process
start), with cumulative numbers per slot: writes never conflict, and one that timed out is
simply repeated by the next (it rewrites the same numbers, plus what came since). `read`
sums the other processes' rows per key and slot. A process that died leaves its rows, which
keep counting until they expire (their slot older than the limit's period); every write
deletes the expired rows of any process.

Blocking, on an engine with short timeouts (`registry.replicas.membership_engine`): callers
on an event loop run it in a thread.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, delete, func, select
from sqlalchemy.dialects import postgresql, sqlite

from registry.schema import RateLimitSpendRow


@dataclass(frozen=True, slots=True)
class SlotSpend:
    """Requests and tokens admitted for `key` in slot `slot` of length `span` seconds (its
    start `slot * span` seconds after the Unix epoch); counted until `expires` (Unix time)."""

    key: str
    span: int
    slot: int
    requests: int
    tokens: int
    expires: float = 0.0


class RateLimitBook:
    """`hub_rate_limit_spend`; every method is one short transaction. Blocking."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def write(self, replica: str, incarnation: str, spends: Sequence[SlotSpend], now: float) -> int:
        """Write this process's cumulative numbers for the slots in `spends` (insert or
        overwrite its rows) and delete every process's rows expired at `now` (Unix time).
        Returns the rows written."""
        values = [
            {"key_name": s.key, "incarnation": incarnation, "span": s.span, "slot": s.slot,
             "replica": replica, "requests": s.requests, "tokens": s.tokens,
             "expires_at": _moment(s.expires)}
            for s in sorted(spends, key=lambda s: (s.key, s.span, s.slot))
        ]  # fmt: skip
        with self.engine.begin() as conn:
            if values:
                insert = _insert(self.engine)
                upsert = insert.on_conflict_do_update(
                    index_elements=["key_name", "incarnation", "span", "slot"],
                    set_={c: insert.excluded[c] for c in ("requests", "tokens", "expires_at")},
                )
                conn.execute(upsert, values)
            expired = delete(RateLimitSpendRow).where(RateLimitSpendRow.expires_at < _moment(now))
            conn.execute(expired)
        return len(values)

    def read(self, exclude_incarnation: str, now: float) -> list[SlotSpend]:
        """The other processes' rows not expired at `now`, summed per key, span and slot."""
        row = RateLimitSpendRow
        statement = (
            select(row.key_name, row.span, row.slot, func.sum(row.requests), func.sum(row.tokens))
            .where(row.incarnation != exclude_incarnation, row.expires_at >= _moment(now))
            .group_by(row.key_name, row.span, row.slot)
        )
        with self.engine.connect() as conn:
            rows = conn.execute(statement).all()
        return [
            SlotSpend(key, int(span), int(slot), int(requests or 0), int(tokens or 0))
            for key, span, slot, requests, tokens in rows
        ]


def _insert(engine: Engine) -> Any:
    dialect = engine.dialect.name
    if dialect == "postgresql":
        return postgresql.insert(RateLimitSpendRow)
    if dialect == "sqlite":
        return sqlite.insert(RateLimitSpendRow)
    raise NotImplementedError(f"shared rate limits need PostgreSQL or SQLite, not {dialect}")


def _moment(unix: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(unix, dt.UTC)
