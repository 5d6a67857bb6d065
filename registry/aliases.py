"""Alias moves with an audit trail, kept consistent between MLflow and SQL.

MLflow's aliases are authoritative; the hub serves the audit log's record of them (the last
event of each alias), which the reconciler keeps equal to MLflow's: a move made in MLflow
directly is recorded as a `sync` event within a poll. Serving thus reads SQL only, and keeps
working, with the aliases last seen, while MLflow is down. Every move is also a
`hub_alias_events` row naming the actor, the reason, the version before and after, and the
validation result. A move runs inside one SQL transaction that first locks the model's row
(`SELECT ... FOR UPDATE` on PostgreSQL; the write that opens the transaction takes SQLite's
database write lock), checks the alias still points where the caller expects, writes the
event, sets the MLflow alias and commits. Concurrent moves of one model are thereby
serialised, and a move based on a stale view fails instead of overwriting a newer one. If
MLflow fails the event is rolled back; if the commit fails after MLflow moved, the
reconciler finds the drift and records it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from registry.db import Database
from registry.errors import ConflictError, NotFoundError
from registry.mlflow_store import MlflowStore
from registry.schema import AliasEvent, ModelVersion, RegisteredModel, utcnow
from registry.traffic import TrafficBook
from registry.views import EventView

log = logging.getLogger(__name__)

STAGES = ("staging", "production")
PRODUCTION = "production"
# Audit events that move no alias: a refused promotion, a traffic policy change.
NON_MOVES = frozenset({"rejected", "traffic"})
# Sentinel for "do not check where the alias points before moving it".
ANY = object()


def event_view(row: AliasEvent, model_name: str) -> EventView:
    return EventView(
        id=row.id,
        model=model_name,
        alias=row.alias,
        action=row.action,
        version=row.version,
        from_version=row.from_version,
        actor=row.actor,
        reason=row.reason,
        validation=row.validation,
        created_at=row.created_at,
    )


class AliasBook:
    """Moves aliases (see the module docstring). A move of `production` away from a version
    also resolves the model's traffic split naming it, in the same transaction: the leaving
    version's weight goes to the new production version, and the event's reason says so."""

    def __init__(
        self, db: Database, mlflow: MlflowStore, traffic: TrafficBook | None = None
    ) -> None:
        self.db = db
        self.mlflow = mlflow
        self.traffic = traffic

    def move(
        self,
        name: str,
        alias: str,
        version: int | None,
        *,
        actor: str,
        reason: str = "",
        action: str | None = None,
        validation: dict[str, Any] | None = None,
        expected: int | object | None = ANY,
    ) -> EventView:
        """Point `alias` at `version` (None removes it) and record the move; with `expected`,
        refuse (ConflictError) unless the alias currently points at that version."""
        with self._locked(name) as (s, model):
            if version is not None:
                exists = s.scalar(
                    select(ModelVersion.id).where(
                        ModelVersion.model_id == model.id, ModelVersion.version == version
                    )
                )
                if exists is None:
                    raise NotFoundError(f"model {name!r} has no version {version}")
            current = self.mlflow.aliases(name).get(alias)
            if expected is not ANY and current != expected:
                raise ConflictError(
                    f"{name}@{alias} moved to {_v(current)} while this change was prepared "
                    f"against {_v(expected)}; nothing was changed, retry"
                )
            if version is not None and current == version and action is None:
                raise ConflictError(f"{name}@{alias} already points to version {version}")
            if action is None:
                action = "set" if current is None else ("remove" if version is None else "move")
            if (
                self.traffic is not None
                and alias == PRODUCTION
                and current is not None
                and version is not None
                and current != version
            ):
                note = self.traffic.resolve_leaving(s, model, current, version, actor=actor)
                if note is not None:
                    reason = f"{reason}; {note}" if reason else note
            event = AliasEvent(
                model_id=model.id,
                alias=alias,
                action=action,
                version=version,
                from_version=current,
                actor=actor,
                reason=reason,
                validation=validation,
            )
            s.add(event)
            s.flush()
            if version is None:
                if current is not None:
                    self.mlflow.delete_alias(name, alias)
            else:
                self.mlflow.set_alias(name, alias, version)
            view = event_view(event, name)
        log.info("%s@%s: %s -> %s by %s (%s)", name, alias, _v(view.from_version),
                 _v(view.version), actor, action)  # fmt: skip
        return view

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[tuple[Session, RegisteredModel]]:
        """A transaction holding the model's lock until it commits: `SELECT ... FOR UPDATE` on
        PostgreSQL; on SQLite the row update below takes the database's write lock."""
        with self.db.session() as s:
            model = s.scalar(
                select(RegisteredModel).where(RegisteredModel.name == name).with_for_update()
            )
            if model is None:
                raise NotFoundError(f"model {name!r} is not registered")
            s.execute(
                update(RegisteredModel)
                .where(RegisteredModel.id == model.id)
                .values(updated_at=utcnow())
            )
            yield s, model

    def confirm_drift(
        self, name: str, alias: str, *, repair: bool
    ) -> tuple[int | None, int | None] | None:
        """Re-check one alias under the model's lock, so a move half-way through (audit row
        written, MLflow not yet, or the reverse) is never mistaken for drift. Returns
        (MLflow's version, the audit log's) if they still differ, recording MLflow's state as
        a `sync` event when `repair`; None if they agree."""
        with self._locked(name) as (s, model):
            now = self.mlflow.aliases(name).get(alias)
            was = self._recorded(s, model.id).get(alias)
            if now == was:
                return None
            if repair:
                s.add(
                    AliasEvent(
                        model_id=model.id, alias=alias, action="sync", version=now,
                        from_version=was, actor="reconciler",
                        reason=f"observed in MLflow: {alias} is {_v(now)} while the audit log "
                        f"had {_v(was)} (moved outside the hub, or a write failed half-way)",
                    )
                )  # fmt: skip
            return now, was

    def record_rejection(
        self,
        name: str,
        alias: str,
        version: int,
        *,
        current: int | None,
        actor: str,
        reason: str,
        validation: dict[str, Any],
    ) -> EventView:
        """Audit a promotion whose gate failed; the alias does not move."""
        return self._record(name, alias, "rejected", version, current, actor, reason, validation)

    def _record(
        self,
        name: str,
        alias: str,
        action: str,
        version: int | None,
        from_version: int | None,
        actor: str,
        reason: str,
        validation: dict[str, Any] | None,
    ) -> EventView:
        with self.db.session() as s:
            model = s.scalar(select(RegisteredModel).where(RegisteredModel.name == name))
            if model is None:
                raise NotFoundError(f"model {name!r} is not registered")
            event = AliasEvent(
                model_id=model.id,
                alias=alias,
                action=action,
                version=version,
                from_version=from_version,
                actor=actor,
                reason=reason,
                validation=validation,
            )
            s.add(event)
            s.flush()
            return event_view(event, name)

    def history(self, name: str, alias: str) -> list[EventView]:
        """Every recorded move of `alias` (not rejected attempts), oldest first."""
        with self.db.session() as s:
            rows = s.execute(
                select(AliasEvent, RegisteredModel.name)
                .join(RegisteredModel)
                .where(
                    RegisteredModel.name == name,
                    AliasEvent.alias == alias,
                    AliasEvent.action.not_in(NON_MOVES),
                )
                .order_by(AliasEvent.id)
            ).all()
            return [event_view(e, n) for e, n in rows]

    def recorded(self, name: str) -> dict[str, int]:
        """{alias: version} as the audit log has them (the last event of each alias)."""
        with self.db.session() as s:
            model_id = s.scalar(select(RegisteredModel.id).where(RegisteredModel.name == name))
            if model_id is None:
                raise NotFoundError(f"model {name!r} is not registered")
            return self._recorded(s, model_id)

    @staticmethod
    def _recorded(s: Session, model_id: int) -> dict[str, int]:
        return AliasBook.recorded_by_model(s, model_id).get(model_id, {})

    @staticmethod
    def recorded_by_model(s: Session, model_id: int | None = None) -> dict[int, dict[str, int]]:
        """{model id: {alias: version}} as the audit log has them, for one model or all."""
        out: dict[int, dict[str, int]] = {}
        query = select(AliasEvent.model_id, AliasEvent.alias, AliasEvent.version).where(
            AliasEvent.action.not_in(NON_MOVES)
        )
        if model_id is not None:
            query = query.where(AliasEvent.model_id == model_id)
        for owner, alias, version in s.execute(query.order_by(AliasEvent.id)):
            aliases = out.setdefault(owner, {})
            if version is None:
                aliases.pop(alias, None)
            else:
                aliases[alias] = version
        return out

    def rollback_target(self, name: str, alias: str = "production") -> tuple[int, int]:
        """(current, previous) production versions from the audit log. Promotions push onto a
        stack and rollbacks pop it, so repeated rollbacks walk further back in history."""
        stack: list[int] = []
        for event in self.history(name, alias):
            if event.action == "rollback":
                if stack:
                    stack.pop()
            elif event.version is None:
                stack.clear()
            elif not stack or stack[-1] != event.version:
                stack.append(event.version)
        if len(stack) < 2:
            raise ConflictError(
                f"{name} has no earlier {alias} version to roll back to "
                f"(history: {stack or 'empty'})"
            )
        return stack[-1], stack[-2]

    def passed_stage(self, name: str, version: int, alias: str = "staging") -> bool:
        """Whether `version` was moved to `alias` with a passing validation gate."""
        return any(
            e.version == version and (e.validation or {}).get("passed") is True
            for e in self.history(name, alias)
        )


def _v(version: object) -> str:
    return "-" if version is None else f"v{version}"
