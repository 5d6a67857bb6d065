"""Admin control of what is resident: `/admin/models`, `/admin/devices`, and load, unload, pin
and unpin per version (`version`: a number or an alias)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from backends.llm.native_build import KernelReport, kernel_reports
from hub.api.deps import HubDep, ManagerDep, RouterDep, require_admin
from hub.dependencies import GpuReading
from hub.manager import DeviceStatus, HostTierStatus, ModelStatus

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])


class ModelStatusPublic(BaseModel):
    name: str
    version: int
    kind: str
    state: str = Field(description="loading, loaded, warm, evicting, failed or unloaded")
    device: str | None
    predicted_bytes: int
    measured_bytes: int
    pinned: bool
    in_flight: int
    waiting: int
    last_used_s_ago: float
    error: str | None
    host_bytes: int = Field(0, description="bytes parked in the host tier (state warm)")
    keep_alive_s: float = Field(0.0, description="keep-alive in force; -1 keeps it forever")
    keep_alive_expires_in_s: float | None = Field(
        None, description="seconds until the keep-alive runs out; null while busy or pinned"
    )
    last_device: str | None = None
    cold_load_s: float | None = None
    warm_load_s: float | None = None
    base: str | None = Field(
        None, description="a LoRA adapter's base version (name@version), whose engine serves it"
    )
    adapters: list[str] = Field(
        default_factory=list,
        description="on a base: its LoRA adapters on the device now (name@version)",
    )

    worker_pids: list[int] = Field(
        default_factory=list,
        description="processes besides the hub's that run the model's compute now (a CPU "
        "encoder's forward workers)",
    )

    @classmethod
    def of(cls, s: ModelStatus) -> ModelStatusPublic:
        return cls(**{**s.__dict__, "adapters": list(s.adapters),
                      "worker_pids": list(s.worker_pids)})  # fmt: skip


class GpuPublic(BaseModel):
    utilization: float = Field(description="share of time a kernel ran (0-1)")
    memory_used_bytes: int = Field(description="used by every process on the GPU")
    memory_total_bytes: int
    temperature_c: float
    power_w: float


class DevicePublic(BaseModel):
    name: str
    budget_bytes: int
    used_bytes: int
    free_bytes: int
    pinned_bytes: int = 0
    models: int = 0
    context_bytes: int = Field(
        0, description="bytes of the budget the device itself holds (a CUDA context)"
    )
    usable: bool = Field(True, description="false once a probe found the device not computing")
    error: str | None = Field(None, description="why the device is not usable")
    gpu: GpuPublic | None = Field(None, description="NVML's figures (null without NVML)")

    @classmethod
    def of(cls, s: DeviceStatus, reading: GpuReading | None = None) -> DevicePublic:
        gpu = GpuPublic(**reading.report()) if reading is not None else None
        return cls(**s.__dict__, gpu=gpu)


class HostTierPublic(BaseModel):
    budget_bytes: int
    used_bytes: int
    free_bytes: int
    models: int
    pinned_memory: bool = Field(description="page-locked host buffers (when a GPU is used)")

    @classmethod
    def of(cls, s: HostTierStatus) -> HostTierPublic:
        return cls(**s.__dict__)


class KernelPublic(BaseModel):
    kernel: str
    state: str = Field(
        description="built (installed library), compiled (at first use), off, unavailable "
        "(no library loads: the slower torch path) or not loaded (no model asked yet)"
    )
    slow_path: bool
    library: str | None
    reason: str | None

    @classmethod
    def of(cls, r: KernelReport) -> KernelPublic:
        return cls(**r.__dict__, slow_path=r.slow_path)


class DeviceList(BaseModel):
    devices: list[DevicePublic]
    host_tier: HostTierPublic
    kernels: list[KernelPublic] = Field(description="the LLM engine's native CPU kernels")


@router.get("/models", response_model=list[ModelStatusPublic])
async def admin_models(manager: ManagerDep) -> list[ModelStatusPublic]:
    return [ModelStatusPublic.of(s) for s in manager.status()]


@router.get("/devices", response_model=DeviceList)
async def admin_devices(manager: ManagerDep, hub: HubDep) -> DeviceList:
    monitor = hub.dependencies.devices
    readings = monitor.readings() if monitor is not None else {}
    return DeviceList(
        devices=[DevicePublic.of(d, readings.get(d.name)) for d in manager.device_status()],
        host_tier=HostTierPublic.of(manager.host_tier_status()),
        kernels=[KernelPublic.of(r) for r in kernel_reports()],
    )


@router.post("/models/{name}/versions/{version}/load", response_model=ModelStatusPublic)
async def load_version(
    name: str, version: str, routes: RouterDep, manager: ManagerDep
) -> ModelStatusPublic:
    route = routes.route_version(name, version)
    return ModelStatusPublic.of(await manager.load(route.name, route.version))


@router.post("/models/{name}/versions/{version}/unload", response_model=ModelStatusPublic)
async def unload_version(
    name: str, version: str, routes: RouterDep, manager: ManagerDep
) -> ModelStatusPublic:
    route = routes.route_version(name, version)
    return ModelStatusPublic.of(await manager.unload(route.name, route.version))


@router.post("/models/{name}/versions/{version}/pin", response_model=ModelStatusPublic)
async def pin_version(
    name: str, version: str, routes: RouterDep, manager: ManagerDep
) -> ModelStatusPublic:
    """Load if needed and keep resident under any pressure; 409 when it cannot fit beside
    the models already pinned."""
    route = routes.route_version(name, version)
    return ModelStatusPublic.of(await manager.pin(route.name, route.version))


@router.post("/models/{name}/versions/{version}/unpin", response_model=ModelStatusPublic)
async def unpin_version(
    name: str, version: str, routes: RouterDep, manager: ManagerDep
) -> ModelStatusPublic:
    route = routes.route_version(name, version)
    return ModelStatusPublic.of(await manager.unpin(route.name, route.version))
