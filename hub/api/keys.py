"""API key admin routes: create, list, read, change and revoke keys with their policies.

`POST /admin/keys` answers 201 with the key itself in `key`, the only time it is shown (the
hub stores its sha256). `PATCH /admin/keys/{name}` changes the fields it names (`null`
clears models, limits or the expiry; `limits` is replaced whole, its per-model limits
included); `DELETE` revokes the key for good. Every replica applies a change within about a
second (hub.auth). A malformed body is a 400 naming the
field, an unknown key a 404, a name in use a 409; an admin key is checked first, as on
every admin route.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Depends
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PositiveInt

from hub.api.deps import get_auth, require_admin
from hub.api.times import UTCDateTime
from hub.auth import Authenticator
from hub.errors import BadRequest
from registry.keys import KeyLimits, KeyView, ModelLimits, Priority

T = TypeVar("T")
router = APIRouter(prefix="/admin/keys", tags=["keys"], dependencies=[Depends(require_admin)])
AuthDep = Annotated[Authenticator, Depends(get_auth)]

# What a key name may hold: it travels in paths and metric labels.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._@:-]{0,199}$"


def _future(value: dt.datetime | None) -> dt.datetime | None:
    """An expiry in UTC (a time without an offset is read as UTC), never in the past."""
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    if value <= dt.datetime.now(dt.UTC):
        raise ValueError("expires_at is in the past; DELETE /admin/keys/{name} revokes a key")
    return value


Expiry = Annotated[dt.datetime | None, AfterValidator(_future)]
ModelRef = Annotated[str, Field(min_length=1, max_length=400, pattern=r"^[^@\s]+(@[^@\s]+)?$")]


class ModelLimitsBody(BaseModel):
    """Rate limits; an absent or null field is no limit of that kind."""

    model_config = ConfigDict(extra="forbid")

    requests_per_minute: PositiveInt | None = None
    tokens_per_minute: PositiveInt | None = None
    tokens_per_day: PositiveInt | None = None
    max_concurrent: PositiveInt | None = None


def _per_model(value: dict[str, ModelLimitsBody] | None) -> dict[str, ModelLimitsBody] | None:
    """Per-model limits keyed by registered names, each setting some limit."""
    for model, limits in (value or {}).items():
        try:
            KeyLimits(models={model: ModelLimits(**limits.model_dump())})
        except ValueError as e:
            raise ValueError(str(e).removeprefix("limits.models.")) from None
    return value


class KeyLimitsBody(ModelLimitsBody):
    """A key's rate limits, over everything it does, and in `models` the same limits of the
    key on one model by registered name (a version or alias counts against its name)."""

    models: Annotated[dict[str, ModelLimitsBody] | None, AfterValidator(_per_model)] = None

    def limits(self) -> KeyLimits:
        own = self.model_dump(exclude={"models"})
        models = {m: ModelLimits(**v.model_dump()) for m, v in (self.models or {}).items()}
        return KeyLimits(**own, models=models)

    @classmethod
    def of(cls, limits: KeyLimits) -> KeyLimitsBody:
        return cls(**limits.to_json())


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    role: Literal["admin", "user"]
    # The models the key may use: names, `name@version`, `name@alias`; absent: every model.
    models: Annotated[list[ModelRef], Field(min_length=1, max_length=1000)] | None = None
    limits: KeyLimitsBody | None = None
    priority: Priority = "standard"
    expires_at: Expiry = None


class KeyUpdate(BaseModel):
    """The fields to change; `null` clears models (every model), limits or the expiry."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["admin", "user"] | None = None
    models: Annotated[list[ModelRef], Field(min_length=1, max_length=1000)] | None = None
    limits: KeyLimitsBody | None = None
    priority: Priority | None = None
    expires_at: Expiry = None


class KeyPublic(BaseModel):
    """A key as listings show it: never the key, only its first characters (`prefix`)."""

    name: str
    prefix: str
    role: str
    models: list[str] | None
    limits: KeyLimitsBody | None
    priority: Priority
    expires_at: UTCDateTime | None
    created_at: UTCDateTime
    revoked_at: UTCDateTime | None

    @classmethod
    def of(cls, view: KeyView) -> KeyPublic:
        policy = view.policy
        limits = policy.limits
        return cls(
            name=view.name,
            prefix=view.prefix,
            role=view.role,
            models=list(policy.models) if policy.models is not None else None,
            limits=KeyLimitsBody.of(limits) if limits is not None else None,
            priority=policy.priority,
            expires_at=policy.expires_at,
            created_at=view.created_at,
            revoked_at=view.revoked_at,
        )


class KeyCreated(KeyPublic):
    # The key itself, shown this once: the hub keeps only its hash.
    key: str


@router.post("", response_model=KeyCreated, status_code=201)
async def create_key(body: KeyCreate, auth: AuthDep) -> KeyCreated:
    limits = body.limits.limits() if body.limits is not None else None
    key, view = await _change(
        auth, auth.keys.create, body.name, body.role, models=body.models, limits=limits,
        priority=body.priority, expires_at=body.expires_at,
    )  # fmt: skip
    return KeyCreated(**KeyPublic.of(view).model_dump(), key=key)


@router.get("", response_model=list[KeyPublic])
async def list_keys(auth: AuthDep) -> list[KeyPublic]:
    return [KeyPublic.of(v) for v in await auth.run_sql(auth.keys.list)]


@router.get("/{name}", response_model=KeyPublic)
async def get_key(name: str, auth: AuthDep) -> KeyPublic:
    return KeyPublic.of(await auth.run_sql(auth.keys.get, name))


@router.patch("/{name}", response_model=KeyPublic)
async def update_key(name: str, body: KeyUpdate, auth: AuthDep) -> KeyPublic:
    changes: dict[str, Any] = {}
    for field in body.model_fields_set:
        value = getattr(body, field)
        if field in ("role", "priority") and value is None:
            raise BadRequest(f"{field} cannot be null", param=field)
        changes[field] = value.limits() if isinstance(value, KeyLimitsBody) else value
    return KeyPublic.of(await _change(auth, auth.keys.update, name, **changes))


@router.delete("/{name}", response_model=KeyPublic)
async def revoke_key(name: str, auth: AuthDep) -> KeyPublic:
    """Revoke the key: every replica refuses it within about a second."""
    return KeyPublic.of(await _change(auth, auth.keys.revoke, name))


async def _change(auth: Authenticator, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """A change to the keys, `fn(*args, **kwargs)` on the authenticator's threads, applied
    on this replica at once; a field the registry refuses is a 400."""
    try:
        result = await auth.run_sql(fn, *args, **kwargs)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    auth.drop_cache()
    return result
