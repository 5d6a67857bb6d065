"""Admin control of what is resident: `/admin/models`, `/admin/devices`, load and unload."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import BaseModel

from hub.api.deps import HubDep, require_admin
from hub.manager import ModelStatus

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])


class ModelStatusPublic(BaseModel):
    name: str
    version: int
    kind: str
    state: str
    device: str | None
    predicted_bytes: int
    measured_bytes: int
    pinned: bool
    in_flight: int
    waiting: int
    last_used_s_ago: float
    error: str | None

    @classmethod
    def of(cls, s: ModelStatus) -> ModelStatusPublic:
        return cls(**s.__dict__)


class DevicePublic(BaseModel):
    name: str
    budget_bytes: int
    used_bytes: int
    free_bytes: int


class DeviceList(BaseModel):
    devices: list[DevicePublic]


@router.get("/models", response_model=list[ModelStatusPublic])
async def admin_models(hub: HubDep) -> list[ModelStatusPublic]:
    return [ModelStatusPublic.of(s) for s in hub.manager.status()]


@router.get("/devices", response_model=DeviceList)
async def admin_devices(hub: HubDep) -> DeviceList:
    used = hub.manager.device_usage()
    return DeviceList(
        devices=[
            DevicePublic(
                name=d.name,
                budget_bytes=d.budget_bytes,
                used_bytes=used.get(d.name, 0),
                free_bytes=max(0, d.budget_bytes - used.get(d.name, 0)),
            )
            for d in hub.manager.devices
        ]
    )


@router.post("/models/{name}/versions/{version}/load", response_model=ModelStatusPublic)
async def load_version(name: str, version: str, hub: HubDep) -> ModelStatusPublic:
    route = hub.router.route_version(name, version)
    return ModelStatusPublic.of(await hub.manager.load(route.name, route.version))


@router.post("/models/{name}/versions/{version}/unload", response_model=ModelStatusPublic)
async def unload_version(name: str, version: str, hub: HubDep) -> ModelStatusPublic:
    route = hub.router.route_version(name, version)
    return ModelStatusPublic.of(await hub.manager.unload(route.name, route.version))
