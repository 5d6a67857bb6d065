"""Registry admin routes: register versions, list them, read the audit log."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field

from hub.api.deps import HubDep, require_admin
from registry.views import EventView, VersionView

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
    files: int
    created_at: dt.datetime

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
            files=len(v.manifest),
            created_at=v.created_at,
        )


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
    created_at: dt.datetime

    @classmethod
    def of(cls, e: EventView) -> EventPublic:
        return cls(**e.__dict__)


@router.post("/models", response_model=VersionCreated, status_code=201)
async def register_version(body: VersionCreate, hub: HubDep) -> VersionCreated:
    view = await asyncio.to_thread(
        hub.registry.register,
        body.name,
        body.kind,
        body.source,
        aliases=body.aliases,
        config=body.config,
        description=body.description,
        actor="api",
    )
    await hub.catalog.refresh()
    return VersionCreated(name=view.name, version=view.version)


@router.get("/models/{name}/versions", response_model=list[VersionPublic])
async def list_versions(name: str, hub: HubDep) -> list[VersionPublic]:
    model = await asyncio.to_thread(hub.registry.get_model, name)
    return [VersionPublic.of(model.versions[v]) for v in sorted(model.versions)]


@router.get("/events", response_model=list[EventPublic])
async def list_events(
    hub: HubDep, model: str | None = None, limit: int = Query(default=100, ge=1, le=1000)
) -> list[EventPublic]:
    events = await asyncio.to_thread(hub.registry.events, model, limit)
    return [EventPublic.of(e) for e in events]
