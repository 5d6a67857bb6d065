"""Traffic policies in SQL: a model's split over versions, its shadow and injected faults.

A policy is replaced whole, inside one transaction that holds the model's lock (`UPDATE` of
its row first: a row lock on PostgreSQL, the database write lock on SQLite): the old split
rows are deleted and the new ones inserted, so a reader never sees half a split. Every change
increments the policy's revision. A model with no split rows is served its default version
(the `production` alias, else the latest); that is also what `clear` returns it to.

Validation happens here, under the lock, against what is registered at that moment: weights
are finite, non-negative and sum to 100; every version exists; every version belongs to a
model of the policy model's kind. Refusals raise `InvalidTrafficError` naming the entry.
While a canary of the model is running, only the canary controller changes the split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session, selectinload

from registry.db import Database
from registry.errors import ConflictError, InvalidTrafficError, NotFoundError
from registry.schema import AliasEvent, Canary, RegisteredModel, TrafficPolicy, TrafficSplit
from registry.views import FaultView, ShadowView, SplitView, TrafficPolicyView

WEIGHT_TOTAL = 100.0
# Weights are percents given by people and CLIs ("33.3"); a sum within this of 100 is 100.
WEIGHT_TOLERANCE = 1e-6
MAX_SPLIT_ENTRIES = 64
MAX_DELAY_MS = 60_000.0


def lock_model(s: Session, name: str) -> RegisteredModel:
    """Take the model's lock for the rest of the transaction and return its row. The first
    statement is a write, so on SQLite the transaction holds the write lock before it reads
    anything (a read first could deadlock with another writer upgrading its lock)."""
    s.execute(
        update(RegisteredModel)
        .where(RegisteredModel.name == name)
        .values(updated_at=RegisteredModel.updated_at)
    )
    model = s.scalar(
        select(RegisteredModel)
        .where(RegisteredModel.name == name)
        .options(selectinload(RegisteredModel.versions))
        .with_for_update()
    )
    if model is None:
        known = s.scalars(select(RegisteredModel.name).order_by(RegisteredModel.name)).all()
        raise NotFoundError(
            f"model {name!r} is not registered (known: {', '.join(known) or 'none'})"
        )
    return model


def running_canary(s: Session, model_id: int) -> Canary | None:
    return s.scalar(select(Canary).where(Canary.model_id == model_id, Canary.state == "running"))


class TrafficBook:
    """Reads and replaces traffic policies; see the module docstring for the contract."""

    def __init__(self, db: Database) -> None:
        self.db = db

    # ---- reads --------------------------------------------------------------------------
    def policies(self, s: Session) -> dict[str, TrafficPolicyView]:
        """Every stored policy by model name, read inside the caller's session (so the
        registry snapshot sees models and policies at one moment)."""
        names: dict[int, str] = dict(
            s.execute(select(RegisteredModel.id, RegisteredModel.name)).tuples().all()
        )
        splits: dict[int, list[SplitView]] = {}
        for row in s.scalars(select(TrafficSplit).order_by(TrafficSplit.id)):
            splits.setdefault(row.model_id, []).append(
                SplitView(model=names[row.target_model_id], version=row.version, weight=row.weight)
            )
        out = {}
        for policy in s.scalars(select(TrafficPolicy)):
            name = names[policy.model_id]
            out[name] = _policy_view(name, policy, splits.get(policy.model_id, []), names)
        return out

    def get(self, name: str) -> TrafficPolicyView:
        """The stored policy of `name`, or the default (no split) if none was ever set."""
        with self.db.session() as s:
            model_id = s.scalar(select(RegisteredModel.id).where(RegisteredModel.name == name))
            if model_id is None:
                raise NotFoundError(f"model {name!r} is not registered")
            return self.policies(s).get(name, TrafficPolicyView(model=name))

    # ---- writes -------------------------------------------------------------------------
    def replace(
        self,
        name: str,
        splits: Sequence[SplitView],
        *,
        shadow: ShadowView | None = None,
        faults: Sequence[FaultView] = (),
        actor: str,
    ) -> TrafficPolicyView:
        """Replace the whole policy of `name` atomically; refused while a canary runs."""
        if not splits:
            raise InvalidTrafficError(
                "splits must name at least one version (clear the policy to return to the "
                "default: everything to production)"
            )
        with self.db.session() as s:
            model = lock_model(s, name)
            _refuse_during_canary(s, model)
            self._write(s, model, splits, shadow=shadow, faults=faults, actor=actor)
        return self.get(name)

    def clear(self, name: str, *, actor: str) -> TrafficPolicyView:
        """Back to the default (everything to production, no shadow, no faults)."""
        with self.db.session() as s:
            model = lock_model(s, name)
            _refuse_during_canary(s, model)
            self._write(s, model, [], shadow=None, faults=(), actor=actor)
        return self.get(name)

    def write_splits(
        self, s: Session, model: RegisteredModel, splits: Sequence[SplitView], *, actor: str
    ) -> None:
        """Replace only the split (keeping shadow and faults) inside the caller's transaction,
        which must hold the model's lock: how a canary moves its weights."""
        policy = s.scalar(select(TrafficPolicy).where(TrafficPolicy.model_id == model.id))
        shadow = faults = None
        if policy is not None:
            names = dict(s.execute(select(RegisteredModel.id, RegisteredModel.name)).tuples().all())
            view = _policy_view(model.name, policy, [], names)
            shadow, faults = view.shadow, view.faults
        self._write(s, model, splits, shadow=shadow, faults=faults or (), actor=actor)

    def resolve_leaving(
        self, s: Session, model: RegisteredModel, leaving: int, arriving: int, *, actor: str
    ) -> str | None:
        """Production of `model` moves from `leaving` to `arriving` (a rollback, a promotion):
        inside the caller's transaction, which holds the model's lock, the weight of a split
        entry naming `leaving` moves to `arriving` (merged with its own entry, if any; a split
        left with `arriving` alone becomes the default). Returns what happened to the split,
        for the audit event; None when no split names `leaving`."""
        names = dict(s.execute(select(RegisteredModel.id, RegisteredModel.name)).tuples().all())
        rows = s.scalars(
            select(TrafficSplit).where(TrafficSplit.model_id == model.id).order_by(TrafficSplit.id)
        ).all()
        splits = [SplitView(names[r.target_model_id], r.version, r.weight) for r in rows]
        moved = sum(x.weight for x in splits if (x.model, x.version) == (model.name, leaving))
        if not any((x.model, x.version) == (model.name, leaving) for x in splits):
            return None
        canary = running_canary(s, model.id)
        if canary is not None:
            return (
                f"the split names v{leaving} but a canary of v{canary.canary_version} owns it; "
                "left to the canary"
            )
        merged: dict[tuple[str, int], float] = {}
        for x in splits:
            key = (
                (model.name, arriving)
                if (x.model, x.version) == (model.name, leaving)
                else (x.model, x.version)
            )
            merged[key] = merged.get(key, 0.0) + x.weight
        resolved = [SplitView(m, v, w) for (m, v), w in merged.items()]
        if len(resolved) == 1 and resolved[0].version == arriving:
            resolved = []  # everything to production: the default
        self.write_splits(s, model, resolved, actor=actor)
        now = _describe(model.name, resolved, None, ())
        return f"traffic split resolved: v{leaving}'s {moved:g}% moved to v{arriving} ({now})"

    def _write(
        self,
        s: Session,
        model: RegisteredModel,
        splits: Sequence[SplitView],
        *,
        shadow: ShadowView | None,
        faults: Sequence[FaultView],
        actor: str,
    ) -> None:
        split_rows = _check_splits(s, model, splits)
        shadow_target = _check_shadow(s, model, shadow) if shadow is not None else None
        fault_docs = _check_faults(s, model, faults)
        policy = s.scalar(select(TrafficPolicy).where(TrafficPolicy.model_id == model.id))
        if policy is None:
            policy = TrafficPolicy(model_id=model.id, revision=0, faults=[])
            s.add(policy)
        policy.revision = (policy.revision or 0) + 1
        policy.shadow_model_id = shadow_target.id if shadow_target is not None else None
        policy.shadow_version = shadow.version if shadow is not None else None
        policy.shadow_percent = shadow.percent if shadow is not None else 0.0
        policy.faults = fault_docs
        policy.updated_by = actor
        s.execute(delete(TrafficSplit).where(TrafficSplit.model_id == model.id))
        for target, split in split_rows:
            s.add(
                TrafficSplit(
                    model_id=model.id,
                    target_model_id=target.id,
                    version=split.version,
                    weight=float(split.weight),
                )
            )
        # Every change is in the audit log next to the alias moves (it moves no alias).
        s.add(
            AliasEvent(
                model_id=model.id,
                alias="",
                action="traffic",
                actor=actor,
                reason=_describe(model.name, splits, shadow, faults),
            )
        )
        s.flush()


def _describe(
    name: str,
    splits: Sequence[SplitView],
    shadow: ShadowView | None,
    faults: Sequence[FaultView],
) -> str:
    """The new policy in a line: "split v1 90%, v2 10%; shadow v3 5%; faults v2 10% errors"."""

    def version(model: str, v: int) -> str:
        return f"v{v}" if model == name else f"{model}@{v}"

    parts = [
        "split " + ", ".join(f"{version(x.model, x.version)} {x.weight:g}%" for x in splits)
        if splits
        else "default split (everything to production)"
    ]
    if shadow is not None:
        parts.append(f"shadow {version(shadow.model, shadow.version)} {shadow.percent:g}%")
    for f in faults:
        delay = f" + {f.delay_ms:g} ms" if f.delay_ms else ""
        parts.append(f"faults {version(f.model, f.version)} {f.error_percent:g}% errors{delay}")
    return "; ".join(parts)


def _refuse_during_canary(s: Session, model: RegisteredModel) -> None:
    canary = running_canary(s, model.id)
    if canary is not None:
        raise ConflictError(
            f"a canary of {model.name} v{canary.canary_version} is running and owns the split; "
            f"abort it first (`hub canary abort {model.name}`)"
        )


def _policy_view(
    name: str, policy: TrafficPolicy, splits: list[SplitView], names: dict[int, str]
) -> TrafficPolicyView:
    shadow = None
    if policy.shadow_version is not None and policy.shadow_model_id is not None:
        shadow = ShadowView(
            model=names[policy.shadow_model_id],
            version=policy.shadow_version,
            percent=policy.shadow_percent,
        )
    faults = tuple(
        FaultView(
            model=f["model"],
            version=int(f["version"]),
            error_percent=float(f["error_percent"]),
            delay_ms=float(f["delay_ms"]),
        )
        for f in policy.faults or []
    )
    return TrafficPolicyView(
        model=name,
        splits=tuple(splits),
        shadow=shadow,
        faults=faults,
        revision=policy.revision,
        updated_by=policy.updated_by,
        updated_at=policy.updated_at,
    )


def _a(kind: str) -> str:
    return f"an {kind}" if kind[:1] in "aeiou" else f"a {kind}"


def _target(
    s: Session, model: RegisteredModel, target_name: str, version: int, where: str
) -> RegisteredModel:
    """The model whose `version` an entry names, checked to exist and to share the kind."""
    if target_name == model.name:
        target: RegisteredModel | None = model
    else:
        target = s.scalar(
            select(RegisteredModel)
            .where(RegisteredModel.name == target_name)
            .options(selectinload(RegisteredModel.versions))
        )
        if target is None:
            raise InvalidTrafficError(f"{where}: model {target_name!r} is not registered")
    assert target is not None
    if target.kind != model.kind:
        raise InvalidTrafficError(
            f"{where}: {target.name} is {_a(target.kind)} but {model.name} is "
            f"{_a(model.kind)}; "
            "one policy only mixes versions of one kind"
        )
    versions = sorted(v.version for v in target.versions)
    if version not in versions:
        known = ", ".join(str(v) for v in versions) or "none"
        raise InvalidTrafficError(
            f"{where}: model {target.name} has no version {version} (versions: {known})"
        )
    return target


def _check_splits(
    s: Session, model: RegisteredModel, splits: Sequence[SplitView]
) -> list[tuple[RegisteredModel, SplitView]]:
    if len(splits) > MAX_SPLIT_ENTRIES:
        raise InvalidTrafficError(f"splits: at most {MAX_SPLIT_ENTRIES} entries")
    rows = []
    seen: set[tuple[str, int]] = set()
    for i, split in enumerate(splits):
        where = f"splits[{i}]"
        if not math.isfinite(split.weight) or not 0 <= split.weight <= WEIGHT_TOTAL:
            raise InvalidTrafficError(f"{where}: weight {split.weight:g} is not within 0..100")
        key = (split.model, split.version)
        if key in seen:
            raise InvalidTrafficError(f"{where}: {split.model} v{split.version} is listed twice")
        seen.add(key)
        rows.append((_target(s, model, split.model, split.version, where), split))
    total = sum(split.weight for split in splits)
    if splits and abs(total - WEIGHT_TOTAL) > WEIGHT_TOLERANCE:
        listed = " + ".join(f"{split.weight:g}" for split in splits)
        raise InvalidTrafficError(f"splits: weights must sum to 100, not {listed} = {total:g}")
    return rows


def _check_shadow(s: Session, model: RegisteredModel, shadow: ShadowView) -> RegisteredModel:
    if not math.isfinite(shadow.percent) or not 0 < shadow.percent <= 100:
        raise InvalidTrafficError(f"shadow: percent {shadow.percent:g} is not within (0, 100]")
    return _target(s, model, shadow.model, shadow.version, "shadow")


def _check_faults(
    s: Session, model: RegisteredModel, faults: Sequence[FaultView]
) -> list[dict[str, Any]]:
    docs = []
    seen: set[tuple[str, int]] = set()
    for i, fault in enumerate(faults):
        where = f"faults[{i}]"
        if not math.isfinite(fault.error_percent) or not 0 <= fault.error_percent <= 100:
            raise InvalidTrafficError(
                f"{where}: error_percent {fault.error_percent:g} is not within 0..100"
            )
        if not math.isfinite(fault.delay_ms) or not 0 <= fault.delay_ms <= MAX_DELAY_MS:
            raise InvalidTrafficError(
                f"{where}: delay_ms {fault.delay_ms:g} is not within 0..{MAX_DELAY_MS:g}"
            )
        if (fault.model, fault.version) in seen:
            raise InvalidTrafficError(f"{where}: {fault.model} v{fault.version} is listed twice")
        seen.add((fault.model, fault.version))
        _target(s, model, fault.model, fault.version, where)
        docs.append(
            {
                "model": fault.model,
                "version": fault.version,
                "error_percent": fault.error_percent,
                "delay_ms": fault.delay_ms,
            }
        )
    return docs
