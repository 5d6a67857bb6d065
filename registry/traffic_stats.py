"""Traffic statistics shared through SQL: each hub process's cumulative counts per model
version and traffic-policy revision (`hub_traffic_stats`), and their sum for readouts.

A process writes its own rows only (`flush`), each keyed by its `incarnation` (unique per
process start), so writes never conflict and a flush that timed out can simply be repeated:
it rewrites the same cumulative numbers. Rows are keyed by the policy revision the process
served under, so "the traffic since the split changed" is a revision, not a time, and
replicas whose clocks disagree still add up; a replica that died leaves its last flushed
row, which keeps counting. Rows untouched for `retention` are deleted by the next flush.

Blocking, on an engine with short timeouts (`registry.replicas.membership_engine`): callers
on an event loop run it in a thread.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, delete, select
from sqlalchemy.orm import sessionmaker

from registry.errors import NotFoundError
from registry.schema import RegisteredModel, TrafficPolicy, TrafficStatsRow, utcnow


@dataclass(frozen=True)
class VersionTraffic:
    """One process's cumulative traffic to one version under one policy revision."""

    model: str
    label: str
    revision: int
    requests: int
    routed: int
    errors: int
    tokens: int
    busy_s: float
    # {bucket index (str): count}, see hub.traffic.histogram
    latency: dict[str, int]
    replica: str = ""


@dataclass(frozen=True)
class SharedTraffic:
    """What `read` returns: the model's current policy revision and the rows of the
    revisions asked for, other processes' only."""

    revision: int
    rows: list[VersionTraffic] = field(default_factory=list)


class TrafficStatsBook:
    """`hub_traffic_stats`; every method is one short transaction. Blocking."""

    def __init__(self, engine: Engine, *, retention: dt.timedelta) -> None:
        self.engine = engine
        self.retention = retention
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    def flush(self, replica: str, incarnation: str, entries: Sequence[VersionTraffic]) -> int:
        """Write this process's cumulative numbers (insert or overwrite its rows); entries
        of models no longer registered are dropped. Returns the rows written."""
        if not entries:
            return 0
        now = utcnow()
        with self._sessions() as s, s.begin():
            ids = dict(
                s.execute(
                    select(RegisteredModel.name, RegisteredModel.id).where(
                        RegisteredModel.name.in_(sorted({e.model for e in entries}))
                    )
                )
                .tuples()
                .all()
            )
            mine = {
                (r.model_id, r.version_label, r.policy_revision): r
                for r in s.scalars(
                    select(TrafficStatsRow).where(
                        TrafficStatsRow.incarnation == incarnation,
                        TrafficStatsRow.model_id.in_(ids.values()),
                    )
                )
            }
            written = 0
            for e in entries:
                model_id = ids.get(e.model)
                if model_id is None:
                    continue
                row = mine.get((model_id, e.label, e.revision))
                if row is None:
                    row = TrafficStatsRow(
                        model_id=model_id,
                        version_label=e.label,
                        policy_revision=e.revision,
                        replica=replica,
                        incarnation=incarnation,
                    )
                    s.add(row)
                row.requests, row.routed, row.errors = e.requests, e.routed, e.errors
                row.tokens, row.busy_s, row.latency = e.tokens, e.busy_s, dict(e.latency)
                row.updated_at = now
                written += 1
            stale = delete(TrafficStatsRow).where(TrafficStatsRow.updated_at < now - self.retention)
            s.execute(stale.execution_options(synchronize_session=False))
            return written

    def read(self, model: str, *, revisions: int, exclude_incarnation: str) -> SharedTraffic:
        """The model's current policy revision R and the rows of revisions R-revisions+1..R
        written by other processes than `exclude_incarnation` (whose numbers the caller
        has fresher in memory)."""
        with self._sessions() as s, s.begin():
            model_id = s.scalar(select(RegisteredModel.id).where(RegisteredModel.name == model))
            if model_id is None:
                raise NotFoundError(f"model {model!r} is not registered")
            current = s.scalar(
                select(TrafficPolicy.revision).where(TrafficPolicy.model_id == model_id)
            )
            revision = int(current or 0)
            rows = s.scalars(
                select(TrafficStatsRow).where(
                    TrafficStatsRow.model_id == model_id,
                    TrafficStatsRow.policy_revision > revision - revisions,
                    TrafficStatsRow.policy_revision <= revision,
                    TrafficStatsRow.incarnation != exclude_incarnation,
                )
            ).all()
            return SharedTraffic(revision, [_traffic(model, r) for r in rows])


def _traffic(model: str, row: TrafficStatsRow) -> VersionTraffic:
    latency: dict[str, Any] = row.latency or {}
    return VersionTraffic(
        model=model,
        label=row.version_label,
        revision=row.policy_revision,
        requests=row.requests,
        routed=row.routed,
        errors=row.errors,
        tokens=row.tokens,
        busy_s=row.busy_s,
        latency={str(k): int(v) for k, v in latency.items()},
        replica=row.replica,
    )
