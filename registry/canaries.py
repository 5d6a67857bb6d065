"""Automated canaries in SQL: start, advance a step, finish; each with the split it implies.

The hub's controller (`hub.traffic.canary`) decides; this module makes every decision one
transaction together with its split, and guards it so replicas sharing the database never
double-apply one: `advance` and `finish` name the step and state they were decided against
(compare-and-set) and return None, changing nothing, when another replica got there first.
A running canary owns its model's split: `TrafficBook.replace` refuses while one runs, and
at most one canary per model runs (a partial unique index backs the check).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import CursorResult, Update, exc, select, update
from sqlalchemy.orm import Session

from registry.db import Database
from registry.errors import ConflictError, InvalidTrafficError, NotFoundError
from registry.schema import Canary, RegisteredModel, utcnow
from registry.traffic import TrafficBook, lock_model, running_canary
from registry.views import CanaryView, SplitView

FINISHED_STATES = ("promoted", "rolled_back", "aborted")


@dataclass(frozen=True)
class CanarySpec:
    """How a canary proceeds: its share of traffic at each step (percent, increasing), how
    long each step lasts at least, and the thresholds a step must stay within."""

    steps: tuple[float, ...] = (5.0, 25.0, 50.0, 100.0)
    interval_s: float = 60.0
    max_error_rate: float = 0.05
    max_latency_ratio: float = 1.5
    min_requests: int = 50

    def check(self) -> None:
        """Raise InvalidTrafficError naming the first unusable field."""
        steps = self.steps
        if not steps:
            raise InvalidTrafficError("steps: give at least one step (e.g. 5,25,50,100)")
        if any(not math.isfinite(w) or not 0 < w <= 100 for w in steps):
            raise InvalidTrafficError(f"steps: every step must be within (0, 100], not {steps}")
        if any(b <= a for a, b in itertools.pairwise(steps)):
            raise InvalidTrafficError(f"steps: must increase strictly, not {steps}")
        if not math.isfinite(self.interval_s) or self.interval_s <= 0:
            raise InvalidTrafficError(f"interval: {self.interval_s} s is not positive")
        if not 0 <= self.max_error_rate <= 1:
            raise InvalidTrafficError(
                f"max_error_rate: {self.max_error_rate} is not a fraction within 0..1"
            )
        if not math.isfinite(self.max_latency_ratio) or self.max_latency_ratio <= 0:
            raise InvalidTrafficError(f"max_latency_ratio: {self.max_latency_ratio} is not > 0")
        if self.min_requests < 1:
            raise InvalidTrafficError(f"min_requests: {self.min_requests} is not >= 1")


def canary_splits(name: str, baseline: int, canary: int, weight: float) -> list[SplitView]:
    """The split of a canary step: `weight` percent to the canary, the rest to the baseline
    (kept at 0 so readouts still show it)."""
    return [
        SplitView(model=name, version=baseline, weight=100.0 - weight),
        SplitView(model=name, version=canary, weight=weight),
    ]


def _rowcount(s: Session, statement: Update) -> int:
    """Rows an UPDATE matched: 1 when a compare-and-set won, 0 when its premise was stale."""
    result = s.execute(statement)
    return int(cast(CursorResult[Any], result).rowcount)


def _view(row: Canary, name: str) -> CanaryView:
    return CanaryView(
        id=row.id,
        model=name,
        canary_version=row.canary_version,
        baseline_version=row.baseline_version,
        steps=tuple(float(w) for w in row.steps),
        step_index=row.step_index,
        step_started_at=row.step_started_at,
        interval_s=row.interval_s,
        max_error_rate=row.max_error_rate,
        max_latency_ratio=row.max_latency_ratio,
        min_requests=row.min_requests,
        state=row.state,
        reason=row.reason,
        last_check=row.last_check,
        actor=row.actor,
        created_at=row.created_at,
        finished_at=row.finished_at,
    )


class CanaryBook:
    def __init__(self, db: Database, traffic: TrafficBook) -> None:
        self.db = db
        self.traffic = traffic

    def start(
        self, name: str, version: int, *, baseline: int, spec: CanarySpec, actor: str, now: float
    ) -> CanaryView:
        """Record a running canary of `version` against `baseline` and set its first step's
        split. Refused (ConflictError) while another canary of the model runs or a split
        other than 100% to the baseline is set (an experiment would silently be lost)."""
        spec.check()
        try:
            with self.db.session() as s:
                model = lock_model(s, name)
                existing = running_canary(s, model.id)
                if existing is not None:
                    raise ConflictError(
                        f"a canary of {name} v{existing.canary_version} is already running; "
                        f"abort it first (`hub canary abort {name}`)"
                    )
                if version not in {v.version for v in model.versions}:
                    known = ", ".join(str(v.version) for v in model.versions) or "none"
                    raise InvalidTrafficError(
                        f"version: model {name} has no version {version} (versions: {known})"
                    )
                self._refuse_over_a_split(s, name, baseline)
                row = Canary(
                    model_id=model.id,
                    canary_version=version,
                    baseline_version=baseline,
                    steps=list(spec.steps),
                    step_index=0,
                    step_started_at=now,
                    interval_s=spec.interval_s,
                    max_error_rate=spec.max_error_rate,
                    max_latency_ratio=spec.max_latency_ratio,
                    min_requests=spec.min_requests,
                    state="running",
                    actor=actor,
                )
                s.add(row)
                s.flush()
                splits = canary_splits(name, baseline, version, spec.steps[0])
                self.traffic.write_splits(s, model, splits, actor=f"canary:{actor}")
                return _view(row, name)
        except exc.IntegrityError as e:  # another replica started one at the same moment
            raise ConflictError(f"a canary of {name} is already running") from e

    def _refuse_over_a_split(self, s: Session, name: str, baseline: int) -> None:
        policy = self.traffic.policies(s).get(name)
        if policy is None:
            return
        serving = [(p.model, p.version) for p in policy.splits if p.weight > 0]
        if serving and serving != [(name, baseline)]:
            listed = ", ".join(f"{p.model}@{p.version}={p.weight:g}" for p in policy.splits)
            raise ConflictError(
                f"{name} has a traffic split ({listed}); clear it first "
                f"(`hub traffic clear {name}`) so the canary starts from production"
            )

    # ---- reads --------------------------------------------------------------------------
    def running(self) -> list[CanaryView]:
        with self.db.session() as s:
            rows = s.execute(
                select(Canary, RegisteredModel.name)
                .join(RegisteredModel, Canary.model_id == RegisteredModel.id)
                .where(Canary.state == "running")
                .order_by(Canary.id)
            ).all()
            return [_view(row, name) for row, name in rows]

    def latest(self, name: str) -> CanaryView | None:
        """The model's running canary, else its most recent one; None if it never had one."""
        with self.db.session() as s:
            model_id = s.scalar(select(RegisteredModel.id).where(RegisteredModel.name == name))
            if model_id is None:
                raise NotFoundError(f"model {name!r} is not registered")
            row = s.scalar(
                select(Canary).where(Canary.model_id == model_id).order_by(Canary.id.desc())
            )
            return _view(row, name) if row is not None else None

    # ---- compare-and-set transitions ----------------------------------------------------
    def advance(
        self, canary: CanaryView, *, now: float, check: dict[str, Any], actor: str
    ) -> CanaryView | None:
        """Move from `canary.step_index` to the next step (its split set in the same
        transaction); past the last step the index marks the promotion as under way and the
        split stays. None if the canary is no longer at that step or no longer running."""
        nxt = canary.step_index + 1
        with self.db.session() as s:
            model = lock_model(s, canary.model)
            moved = _rowcount(
                s,
                update(Canary)
                .where(
                    Canary.id == canary.id,
                    Canary.state == "running",
                    Canary.step_index == canary.step_index,
                )
                .values(step_index=nxt, step_started_at=now, last_check=check),
            )
            if moved != 1:
                return None
            if nxt < len(canary.steps):
                splits = canary_splits(
                    canary.model, canary.baseline_version, canary.canary_version, canary.steps[nxt]
                )
                self.traffic.write_splits(s, model, splits, actor=actor)
            return self._reload(s, canary)

    def finish(
        self,
        canary: CanaryView,
        *,
        state: str,
        reason: str,
        splits: Sequence[SplitView],
        check: dict[str, Any] | None = None,
        actor: str,
    ) -> CanaryView | None:
        """End a running canary in `state` with `reason`, replacing the split with `splits`
        (empty: back to the default). None if it was no longer running."""
        if state not in FINISHED_STATES:
            raise ValueError(f"unknown final state {state!r}")
        with self.db.session() as s:
            model = lock_model(s, canary.model)
            values: dict[str, Any] = {"state": state, "reason": reason, "finished_at": utcnow()}
            if check is not None:
                values["last_check"] = check
            done = _rowcount(
                s,
                update(Canary)
                .where(Canary.id == canary.id, Canary.state == "running")
                .values(**values),
            )
            if done != 1:
                return None
            self.traffic.write_splits(s, model, splits, actor=actor)
            return self._reload(s, canary)

    @staticmethod
    def _reload(s: Session, canary: CanaryView) -> CanaryView:
        s.expire_all()
        row = s.get(Canary, canary.id)
        assert row is not None  # updated in this transaction
        return _view(row, canary.model)
