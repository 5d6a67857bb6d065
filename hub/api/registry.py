"""Registry admin routes: register versions, promote and roll back, aliases, the audit log,
drift between MLflow and SQL."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query
from pydantic import BaseModel, ConfigDict, Field

from backends.runtime_config import RuntimeConfigError, parse_runtime_config
from hub.api.deps import (
    AdminActor,
    ControlDep,
    PromoterDep,
    ReconcilerDep,
    require_admin,
)
from hub.api.times import UTCDateTime
from hub.errors import BadRequest
from hub.validation import parse_eval_set
from registry.aliases import STAGES
from registry.views import EventView, VersionView

# A version number as the registry's database stores it (a signed 64-bit integer): a larger
# one is refused as the caller's mistake (400) rather than overflowing the SQL driver.
MAX_VERSION = 2**63 - 1
VersionNumber = Annotated[int, Field(ge=1, le=MAX_VERSION)]

router = APIRouter(
    prefix="/admin/registry", tags=["registry"], dependencies=[Depends(require_admin)]
)


class VersionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    kind: Literal["llm", "embedder", "reranker"]
    source: str = Field(min_length=1)
    aliases: list[str] = Field(default_factory=list)
    config: dict[str, Any] = Field(default_factory=dict)
    description: str = ""
    # The version's own evaluation set, run by the validation gate (docs/registry.md).
    eval_set: dict[str, Any] | None = None
    base: str | None = Field(
        default=None,
        min_length=1,
        max_length=300,
        description="for a LoRA adapter folder: the registered llm it runs on, as "
        "name@version or name@alias (the alias is resolved now and the version recorded)",
    )


class VersionCreated(BaseModel):
    name: str
    version: int


class VersionPublic(BaseModel):
    name: str
    kind: str
    version: int
    aliases: list[str]
    status: str
    validation: dict[str, Any] | None
    source_uri: str
    mlflow_model_uri: str
    total_bytes: int
    dtype: str
    runtime_config: dict[str, Any]
    eval_set: dict[str, Any] | None
    files: int
    created_at: UTCDateTime
    base: str | None = Field(
        default=None, description="a LoRA adapter's base version (name@version)"
    )

    @classmethod
    def of(cls, v: VersionView) -> VersionPublic:
        return cls(
            name=v.name,
            kind=v.kind,
            version=v.version,
            aliases=list(v.aliases),
            status=v.status,
            validation=v.validation,
            source_uri=v.source_uri,
            mlflow_model_uri=v.mlflow_model_uri,
            total_bytes=v.total_bytes,
            dtype=v.dtype,
            runtime_config=v.runtime_config,
            eval_set=v.eval_set,
            files=len(v.manifest),
            created_at=v.created_at,
            base=str(v.base) if v.base is not None else None,
        )


class ModelSummary(BaseModel):
    name: str
    kind: str
    versions: list[int]
    # alias -> version
    aliases: dict[str, int]


class EventPublic(BaseModel):
    id: int
    model: str
    alias: str
    action: str
    version: int | None
    from_version: int | None
    actor: str
    reason: str
    validation: dict[str, Any] | None
    created_at: UTCDateTime

    @classmethod
    def of(cls, e: EventView) -> EventPublic:
        return cls(**e.__dict__)


class PromoteBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    to: str = Field(description="staging or production")
    reason: str = ""


class RollbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = ""


class AliasBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: VersionNumber
    reason: str = ""


class PromotionPublic(BaseModel):
    name: str
    alias: str
    version: int | None
    from_version: int | None
    validation: dict[str, Any] | None
    event: EventPublic


class DriftPublic(BaseModel):
    model: str
    kind: str
    detail: str
    repaired: bool


@router.post("/models", response_model=VersionCreated, status_code=201)
async def register_version(
    body: VersionCreate, control: ControlDep, reconciler: ReconcilerDep, actor: AdminActor
) -> VersionCreated:
    check_runtime_config(body.kind, body.config)  # 400 naming the key, nothing fetched
    if body.eval_set is not None:
        parse_eval_set(body.kind, body.eval_set)  # 400 naming the bad case, nothing written
    view = await control.register(
        body.name,
        body.kind,
        body.source,
        aliases=body.aliases,
        config=body.config,
        description=body.description,
        eval_set=body.eval_set,
        actor=actor,
        base=body.base,
    )
    reconciler.kick()
    return VersionCreated(name=view.name, version=view.version)


def check_runtime_config(kind: str, config: dict[str, Any]) -> None:
    """BadRequest (400, `param` "config.<key>") for a runtime config `kind` cannot use; the
    registry checks again, with the defaults read from the model's files merged in."""
    try:
        parse_runtime_config(kind, config)
    except RuntimeConfigError as e:
        raise BadRequest(
            f"config.{e.key}: {e.reason}" if e.key else str(e),
            param=f"config.{e.key}" if e.key else "config",
            code="invalid_runtime_config",
        ) from None


def _promotion(event: EventView) -> PromotionPublic:
    return PromotionPublic(
        name=event.model,
        alias=event.alias,
        version=event.version,
        from_version=event.from_version,
        validation=event.validation,
        event=EventPublic.of(event),
    )


@router.post(
    "/models/{name}/versions/{version}/promote",
    response_model=PromotionPublic,
    responses={422: {"description": "the validation gate failed; no alias moved"}},
)
async def promote_version(
    name: str,
    version: Annotated[int, Path(ge=1, le=MAX_VERSION)],
    body: PromoteBody,
    promoter: PromoterDep,
    actor: AdminActor,
) -> PromotionPublic:
    """Run the version through its validation gate, then move `to` (staging or production)."""
    promotion = await promoter.promote(name, version, body.to, actor=actor, reason=body.reason)
    return _promotion(promotion.event)


@router.post("/models/{name}/rollback", response_model=PromotionPublic)
async def rollback_model(
    name: str, promoter: PromoterDep, actor: AdminActor, body: RollbackBody | None = None
) -> PromotionPublic:
    """Move production back to the version before it in the promotion history."""
    reason = body.reason if body is not None else ""
    return _promotion(await promoter.rollback(name, actor=actor, reason=reason))


@router.put("/models/{name}/aliases/{alias}", response_model=PromotionPublic)
async def set_alias(
    name: str, alias: str, body: AliasBody, control: ControlDep, actor: AdminActor
) -> PromotionPublic:
    """Point a free-form alias at a version (staging and production move only by promotion)."""
    _free_form(alias)
    event = await control.set_alias(name, alias, body.version, actor=actor, reason=body.reason)
    return _promotion(event)


@router.delete("/models/{name}/aliases/{alias}", response_model=PromotionPublic)
async def delete_alias(
    name: str, alias: str, control: ControlDep, actor: AdminActor
) -> PromotionPublic:
    _free_form(alias)
    return _promotion(await control.set_alias(name, alias, None, actor=actor))


def _free_form(alias: str) -> None:
    if alias in STAGES:
        raise BadRequest(
            f"{alias!r} moves only through promote (with its validation gate) or rollback",
            param="alias",
        )


@router.get("/drift", response_model=list[DriftPublic])
async def drift(reconciler: ReconcilerDep) -> list[DriftPublic]:
    """Differences between MLflow and SQL found by the reconciler's last full check."""
    return [DriftPublic(**d.__dict__) for d in reconciler.drift]


@router.get("/models", response_model=list[ModelSummary])
async def list_models(control: ControlDep) -> list[ModelSummary]:
    """Registered models with their versions and aliases, as the registry has them now."""
    return [
        ModelSummary(name=m.name, kind=m.kind, versions=sorted(m.versions), aliases=m.aliases)
        for m in await control.models()
    ]


@router.get("/models/{name}/versions", response_model=list[VersionPublic])
async def list_versions(name: str, control: ControlDep) -> list[VersionPublic]:
    model = await control.model(name)
    return [VersionPublic.of(model.versions[v]) for v in sorted(model.versions)]


@router.get("/events", response_model=list[EventPublic])
async def list_events(
    control: ControlDep,
    model: str | None = None,
    limit: int = Query(default=100, ge=1, le=1000),
) -> list[EventPublic]:
    events = await control.events(model, limit)
    return [EventPublic.of(e) for e in events]
