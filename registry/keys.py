"""API keys: created once (the plain key is shown only then), stored as sha256 hashes, each
with a policy: which models it may use, its rate limits, its scheduling priority and when it
expires.

Every change to a key (create, update, revoke) also increments one counter row
(`hub_key_generation`) in the same transaction, so a replica that caches verified keys learns
that its cache may be stale by reading one integer (`ApiKeys.generation`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, Final, Literal, cast, get_args

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from registry.db import Database
from registry.errors import ConflictError, NotFoundError
from registry.schema import ApiKey, KeyGeneration, utcnow

ROLES = ("admin", "user")
Priority = Literal["interactive", "standard", "batch"]
PRIORITIES: tuple[str, ...] = get_args(Priority)
KEY_PREFIX = "hub-"
# Names travel in paths (`/admin/keys/{name}`) and metric labels: no slashes or spaces.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,199}")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# The four limits a key has, and has again for each model it names in `limits.models`.
LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "tokens_per_day", "max_concurrent")
# A registered model's name (registry.service): what per-model limits are keyed by.
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


@dataclass(frozen=True)
class ModelLimits:
    """Rate limits of one scope (a key, or a key on one model); None means no limit of that
    kind. Each given value is a positive integer (ValueError otherwise, naming the field)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        for name in LIMIT_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"limits.{name} must be a positive integer, not {value!r}")

    @cached_property  # read on every limited request
    def empty(self) -> bool:
        """Whether none of the four limits is set."""
        return all(getattr(self, name) is None for name in LIMIT_FIELDS)

    def counts_tokens(self) -> bool:
        return self.tokens_per_minute is not None or self.tokens_per_day is not None

    def to_json(self) -> dict[str, Any]:
        return {n: v for n in LIMIT_FIELDS if (v := getattr(self, n)) is not None}


@dataclass(frozen=True)
class KeyLimits(ModelLimits):
    """A key's rate limits: the four of `ModelLimits` over everything the key does, and
    `models` the same four for the key's requests to one model, by registered name (a
    request naming `name@version` or `name@alias` counts against `name`; a LoRA adapter's
    against its own name and its base model's). A request must fit both its key's limits
    and its model's. ValueError for a bad value or model name, naming the field."""

    models: Mapping[str, ModelLimits] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))
        for model, limits in self.models.items():
            where = f"limits.models.{model}"
            _model_name(model, where)
            if not isinstance(limits, ModelLimits) or isinstance(limits, KeyLimits):
                raise ValueError(f"{where} must be an object of limits")
            if limits.empty:
                raise ValueError(f"{where} sets no limit; leave the model out for none")

    def counts_tokens(self) -> bool:
        return super().counts_tokens() or any(m.counts_tokens() for m in self.models.values())

    @classmethod
    def from_json(cls, value: dict[str, Any] | None) -> KeyLimits | None:
        """The limits a JSON object names (ValueError for an unknown name); None for null."""
        if value is None:
            return None
        _known(value, (*LIMIT_FIELDS, "models"), "limits")
        models = value.get("models") or {}
        if not isinstance(models, dict):
            raise ValueError("limits.models must be an object: model name -> its limits")
        by_model = {}
        for model, limits in models.items():
            if not isinstance(limits, dict):
                raise ValueError(f"limits.models.{model} must be an object of limits")
            _known(limits, LIMIT_FIELDS, f"limits.models.{model}")
            try:
                by_model[model] = ModelLimits(**limits)
            except ValueError as e:  # named as the key's fields are: say which model's
                raise ValueError(str(e).replace("limits.", f"limits.models.{model}.", 1)) from None
        own = {k: v for k, v in value.items() if k != "models"}
        return cls(**own, models=by_model)

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        if self.models:
            out["models"] = {name: limits.to_json() for name, limits in self.models.items()}
        return out


def _known(value: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(
            f"unknown limit {', '.join(unknown)} in {where}; known: {', '.join(known)}"
        )


def _model_name(model: object, where: str) -> None:
    """ValueError unless `model` is a registered model's name (no version or alias)."""
    if isinstance(model, str) and _MODEL_NAME.fullmatch(model):
        return
    name = model.partition("@")[0] if isinstance(model, str) else ""
    if _MODEL_NAME.fullmatch(name):
        raise ValueError(
            f"{where}: limits are per model name (a version or alias counts against its "
            f"name): use {name!r}"
        )
    raise ValueError(f"{where}: not a registered model's name")


@dataclass(frozen=True)
class KeyPolicy:
    """What a verified key may do: `models` the models it may use (`name`, `name@version`,
    `name@alias`; None: every model), `limits` its rate limits (None: none), `priority` its
    scheduling class, `expires_at` when it stops working (None: never)."""

    name: str
    role: str
    models: tuple[str, ...] | None = None
    limits: KeyLimits | None = None
    priority: Priority = "standard"
    expires_at: dt.datetime | None = None

    def expired(self, now: dt.datetime | None = None) -> bool:
        return self.expires_at is not None and self.expires_at <= (now or utcnow())


@dataclass(frozen=True)
class KeyView:
    """A key as listings show it: its policy and bookkeeping, never the key itself."""

    name: str
    prefix: str
    role: str
    created_at: dt.datetime
    revoked_at: dt.datetime | None
    policy: KeyPolicy


class _Unset:
    """The value of an `update` argument that leaves the field as it is."""


UNSET: Final = _Unset()


class ApiKeys:
    """The API keys of one database. Raises NotFoundError for an unknown name, ConflictError
    for a duplicate one and ValueError for a field that cannot be stored (role, priority,
    models, limits, name)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def create(
        self,
        name: str,
        role: str,
        *,
        models: list[str] | tuple[str, ...] | None = None,
        limits: KeyLimits | None = None,
        priority: str = "standard",
        expires_at: dt.datetime | None = None,
    ) -> tuple[str, KeyView]:
        """A new key for `role`; returns the plain key (shown once) and its record."""
        if not _NAME.fullmatch(name):
            raise ValueError(
                f"key name {name!r}: 1-200 letters, digits or . _ @ : -, starting with a "
                "letter or digit"
            )
        row = ApiKey(name=name, role=_role(role), priority=_priority(priority))
        row.models = _models(models)
        row.limits = limits.to_json() if limits is not None else None
        row.expires_at = _aware(expires_at)
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        row.key_hash, row.prefix = hash_key(key), key[:10]
        with self.db.session() as s:
            if s.scalar(select(ApiKey).where(ApiKey.name == name)) is not None:
                raise ConflictError(f"an API key named {name!r} exists already")
            s.add(row)
            _bump(s)
            s.flush()
            return key, _view(row)

    def get(self, name: str) -> KeyView:
        with self.db.session() as s:
            return _view(_row(s, name))

    def update(
        self,
        name: str,
        *,
        role: str | _Unset = UNSET,
        models: list[str] | tuple[str, ...] | _Unset | None = UNSET,
        limits: KeyLimits | _Unset | None = UNSET,
        priority: str | _Unset = UNSET,
        expires_at: dt.datetime | _Unset | None = UNSET,
    ) -> KeyView:
        """Change the fields given (None clears models, limits or expiry); every replica
        applies the change within about a second (hub.auth)."""
        with self.db.session() as s:
            row = _row(s, name)
            if not isinstance(role, _Unset):
                row.role = _role(role)
            if not isinstance(models, _Unset):
                row.models = _models(models)
            if not isinstance(limits, _Unset):
                row.limits = limits.to_json() if limits is not None else None
            if not isinstance(priority, _Unset):
                row.priority = _priority(priority)
            if not isinstance(expires_at, _Unset):
                row.expires_at = _aware(expires_at)
            _bump(s)
            return _view(row)

    def revoke(self, name: str) -> KeyView:
        """Revoke the key for good (a revoked key is never valid again)."""
        with self.db.session() as s:
            row = _row(s, name)
            if row.revoked_at is None:
                row.revoked_at = utcnow()
                _bump(s)
            return _view(row)

    def list(self) -> list[KeyView]:
        with self.db.session() as s:
            return [_view(r) for r in s.scalars(select(ApiKey).order_by(ApiKey.name))]

    def verify(self, key: str) -> KeyPolicy | None:
        """The policy of a valid key: known, not revoked, not expired; else None."""
        with self.db.session() as s:
            row = s.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key)))
            if row is None or row.revoked_at is not None:
                return None
            policy = _view(row).policy
        return None if policy.expired() else policy

    def generation(self) -> int:
        """The count of key changes so far; it moves whenever any key changes."""
        with self.db.session() as s:
            value = s.scalar(select(KeyGeneration.generation).where(KeyGeneration.id == 1))
            return int(value or 0)


def _row(s: Session, name: str) -> ApiKey:
    row = s.scalar(select(ApiKey).where(ApiKey.name == name))
    if row is None:
        raise NotFoundError(f"no API key named {name!r}")
    return row


def _bump(s: Session) -> None:
    """Count a key change, in the caller's transaction."""
    moved = s.execute(
        update(KeyGeneration)
        .where(KeyGeneration.id == 1)
        .values(generation=KeyGeneration.generation + 1)
    )
    if getattr(moved, "rowcount", 1) == 0:  # a schema made without the migration's row
        s.add(KeyGeneration(id=1, generation=1))


def _role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    return role


def _priority(priority: str) -> str:
    if priority not in PRIORITIES:
        raise ValueError(f"unknown priority {priority!r}; expected one of {', '.join(PRIORITIES)}")
    return priority


def _models(models: list[str] | tuple[str, ...] | None) -> list[str] | None:
    """The model list to store: names or `name@ref`, without repeats; None for every model."""
    if models is None:
        return None
    if not models:
        raise ValueError("models: give at least one model, or null for every model")
    out: list[str] = []
    for model in models:
        name, sep, ref = model.partition("@")
        blank = not name.strip() or (sep and not ref.strip()) or model != model.strip()
        if blank or not model.isprintable() or len(model) > 400:
            raise ValueError(
                f"models: {model!r} is not a model name, `name@version` or `name@alias`"
            )
        if model not in out:
            out.append(model)
    return out


def _aware(value: dt.datetime | None) -> dt.datetime | None:
    """`value` with a time zone (UTC when it has none: SQLite hands datetimes back so)."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=dt.UTC)


def _view(row: ApiKey) -> KeyView:
    policy = KeyPolicy(
        name=row.name,
        role=row.role,
        models=tuple(row.models) if row.models is not None else None,
        limits=KeyLimits.from_json(row.limits),
        priority=cast(Priority, row.priority or "standard"),
        expires_at=_aware(row.expires_at),
    )
    return KeyView(row.name, row.prefix, row.role, _aware(row.created_at) or row.created_at,
                   _aware(row.revoked_at), policy)  # fmt: skip
