"""`GET /admin/replicas`: the live hub replicas sharing this database, what each holds, its
free memory per device and its queue depth, read from their heartbeat rows."""

from __future__ import annotations

import datetime as dt

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from hub.api.deps import HubDep, require_admin
from registry.replicas import ReplicaView

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])


class ReplicaModelPublic(BaseModel):
    name: str
    version: int
    kind: str
    state: str = Field(description="loading, loaded, evicting (on a device) or warm (host)")
    device: str | None
    bytes: int
    pinned: bool
    in_flight: int


class ReplicaDevicePublic(BaseModel):
    name: str
    budget_bytes: int
    free_bytes: int


class ReplicaPublic(BaseModel):
    id: str
    address: str = Field(description="base URL at which peers reach the replica")
    hub_version: str
    started_at: dt.datetime
    last_seen: dt.datetime
    seen_s_ago: float
    queue_depth: int = Field(description="requests in flight plus requests waiting for a load")
    devices: list[ReplicaDevicePublic]
    host_free_bytes: int
    models: list[ReplicaModelPublic]
    this: bool = Field(description="true for the replica that answered this request")

    @classmethod
    def of(cls, v: ReplicaView, this_id: str) -> ReplicaPublic:
        return cls(
            id=v.id,
            address=v.address,
            hub_version=v.hub_version,
            started_at=v.started_at,
            last_seen=v.last_seen,
            seen_s_ago=v.seen_s_ago,
            queue_depth=v.queue_depth,
            devices=[ReplicaDevicePublic(**d) for d in v.devices],
            host_free_bytes=v.host_free_bytes,
            models=[ReplicaModelPublic(**m) for m in v.models],
            this=v.id == this_id,
        )


class ReplicaList(BaseModel):
    this_replica: str
    expire_after_s: float = Field(description="a replica silent this long is not listed")
    replicas: list[ReplicaPublic]


@router.get("/replicas", response_model=ReplicaList)
async def list_replicas(hub: HubDep) -> ReplicaList:
    """Live replicas by id; 503 with Retry-After when the database does not answer in time."""
    membership = hub.replicas
    views = await membership.live()
    return ReplicaList(
        this_replica=membership.id,
        expire_after_s=membership.settings.expire_after,
        replicas=[ReplicaPublic.of(v, membership.id) for v in views],
    )
