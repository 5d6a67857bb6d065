"""Traffic admin routes: a model's split, shadow and faults; its readout; its canary.

`PUT /admin/traffic/{name}` replaces the whole policy atomically and this hub serves it at
once (other replicas at their next reconcile). Caller mistakes are 400 naming the entry
(weights not summing to 100, unknown versions, versions of another kind); a change while a
canary owns the split is 409.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from hub.api.deps import AdminActor, HubDep, require_admin
from hub.errors import NotFound
from hub.state import Hub
from hub.traffic.assignment import Arm
from hub.traffic.readout import build_readout
from hub.units import parse_duration
from registry.canaries import CanarySpec
from registry.views import FaultView, ShadowView, SplitView, TrafficPolicyView

router = APIRouter(prefix="/admin/traffic", tags=["traffic"], dependencies=[Depends(require_admin)])


class SplitEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int
    weight: float
    # Another registered model of the same kind (an experiment across model families).
    model: str | None = None


class ShadowEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int
    percent: float
    model: str | None = None


class FaultEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int
    error_percent: float = 0.0
    delay_ms: float = 0.0
    model: str | None = None


class TrafficUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    splits: list[SplitEntry] = Field(min_length=1)
    shadow: ShadowEntry | None = None
    faults: list[FaultEntry] = Field(default_factory=list)


class SplitPublic(BaseModel):
    version: int
    weight: float
    model: str
    # How X-Hub-Model-Version and readouts name it: "3", or "other@3".
    label: str
    # Share of the 10,000 assignment buckets this version holds, percent.
    bucket_share: float | None = None


class TrafficPublic(BaseModel):
    model: str
    kind: str
    # True when no split is stored: everything goes to the default version.
    default: bool
    splits: list[SplitPublic]
    shadow: ShadowEntry | None
    faults: list[FaultEntry]
    revision: int
    updated_by: str
    updated_at: dt.datetime | None
    canary: dict[str, Any] | None


def _seconds(value: Any) -> float:
    return parse_duration(value)


class CanaryCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int
    steps: list[float] = Field(default_factory=lambda: [5.0, 25.0, 50.0, 100.0])
    # Seconds or a duration ("60s", "5m"): how long each step lasts at least.
    interval: Annotated[float, BeforeValidator(_seconds)] = 60.0
    max_error_rate: float = 0.05
    max_latency_ratio: float = 1.5
    min_requests: int = 50


class CanaryAbort(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = ""


def _splits(hub: Hub, name: str, policy: TrafficPolicyView) -> list[SplitPublic]:
    # Bucket shares only when this hub serves exactly this policy (not one a moment older).
    table = hub.router.table(name) if hub.traffic.policy(name) == policy else None
    shares = {a.label(name): s for a, s in table.shares().items()} if table is not None else {}
    out = []
    for split in policy.splits:
        label = Arm(split.model, split.version).label(name)
        share = round(shares.get(label, 0.0) * 100, 2) if table is not None else None
        out.append(SplitPublic(version=split.version, weight=split.weight, model=split.model,
                               label=label, bucket_share=share))  # fmt: skip
    return out


async def _public(hub: Hub, name: str, policy: TrafficPolicyView) -> TrafficPublic:
    model = await asyncio.to_thread(hub.registry.get_model, name)
    latest = await hub.traffic.canaries.status(name)
    running = latest if latest is not None and latest.state == "running" else None
    default = not any(s.weight > 0 for s in policy.splits)
    splits = _splits(hub, name, policy)
    version = model.default_version()
    if default and version is not None:
        splits = [SplitPublic(version=version, weight=100.0, model=name, label=str(version),
                              bucket_share=100.0)]  # fmt: skip
    shadow = policy.shadow
    faults = [
        FaultEntry(version=f.version, error_percent=f.error_percent, delay_ms=f.delay_ms,
                   model=f.model)
        for f in policy.faults
    ]  # fmt: skip
    return TrafficPublic(
        model=name,
        kind=model.kind,
        default=default,
        splits=splits,
        shadow=None
        if shadow is None
        else ShadowEntry(version=shadow.version, percent=shadow.percent, model=shadow.model),
        faults=faults,
        revision=policy.revision,
        updated_by=policy.updated_by,
        updated_at=policy.updated_at,
        canary=hub.traffic.canaries.describe(running),
    )


@router.get("/{name}", response_model=TrafficPublic)
async def get_traffic(name: str, hub: HubDep) -> TrafficPublic:
    """The effective policy: the stored split, or the default (100% to production/latest),
    with shadow, faults and a running canary."""
    policy = await asyncio.to_thread(hub.registry.traffic.get, name)
    return await _public(hub, name, policy)


@router.put("/{name}", response_model=TrafficPublic)
async def put_traffic(
    name: str, body: TrafficUpdate, hub: HubDep, actor: AdminActor
) -> TrafficPublic:
    """Replace the split (and shadow, faults) of `name` atomically."""
    splits = [SplitView(s.model or name, s.version, s.weight) for s in body.splits]
    shadow = (
        ShadowView(body.shadow.model or name, body.shadow.version, body.shadow.percent)
        if body.shadow is not None
        else None
    )
    faults = [
        FaultView(f.model or name, f.version, f.error_percent, f.delay_ms) for f in body.faults
    ]
    policy = await asyncio.to_thread(
        hub.registry.traffic.replace, name, splits, shadow=shadow, faults=faults, actor=actor
    )
    await hub.catalog.refresh()
    return await _public(hub, name, policy)


@router.delete("/{name}", response_model=TrafficPublic)
async def clear_traffic(name: str, hub: HubDep, actor: AdminActor) -> TrafficPublic:
    """Back to the default: everything to production (else the latest), no shadow, no
    faults."""
    policy = await asyncio.to_thread(hub.registry.traffic.clear, name, actor=actor)
    await hub.catalog.refresh()
    return await _public(hub, name, policy)


@router.get("/{name}/readout")
async def readout(name: str, hub: HubDep) -> dict[str, Any]:
    """Per-version requests, errors, latency and tokens per second, a sample-ratio check and
    comparisons with the baseline; from this hub process's samples."""
    view = hub.catalog.model(name)
    canary = await hub.traffic.canaries.status(name)
    return build_readout(
        view,
        hub.traffic.policy(name),
        hub.router.table(name),
        hub.traffic.stats,
        hub.traffic.shadow,
        min_samples=hub.settings.traffic.min_samples,
        canary=hub.traffic.canaries.describe(canary),
    )


@router.post("/{name}/canary", status_code=201)
async def start_canary(
    name: str, body: CanaryCreate, hub: HubDep, actor: AdminActor
) -> dict[str, Any]:
    """Start an automated canary of `version` against production."""
    spec = CanarySpec(
        steps=tuple(body.steps),
        interval_s=body.interval,
        max_error_rate=body.max_error_rate,
        max_latency_ratio=body.max_latency_ratio,
        min_requests=body.min_requests,
    )
    canary = await hub.traffic.canaries.start(name, body.version, spec, actor=actor)
    doc = hub.traffic.canaries.describe(canary)
    assert doc is not None
    return doc


@router.get("/{name}/canary")
async def canary_status(name: str, hub: HubDep) -> dict[str, Any]:
    """The running canary of `name`, else its most recent one."""
    doc = hub.traffic.canaries.describe(await hub.traffic.canaries.status(name))
    if doc is None:
        raise NotFound(f"{name} has never had a canary; start one with `hub canary start`")
    return doc


@router.post("/{name}/canary/abort")
async def abort_canary(
    name: str, hub: HubDep, actor: AdminActor, body: CanaryAbort | None = None
) -> dict[str, Any]:
    """Stop the running canary; all traffic back to the baseline."""
    reason = body.reason if body is not None else ""
    doc = hub.traffic.canaries.describe(
        await hub.traffic.canaries.abort(name, actor=actor, reason=reason)
    )
    assert doc is not None
    return doc
