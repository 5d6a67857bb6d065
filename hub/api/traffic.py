"""Traffic admin routes: a model's split, shadow and faults; its readout; its canary.

`PUT /admin/traffic/{name}` replaces the whole policy atomically and this hub serves it at
once (other replicas at their next reconcile). Caller mistakes are 400 naming the entry
(weights not summing to 100, unknown versions, versions of another kind); a change while a
canary owns the split is 409.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from hub.api.deps import (
    AdminActor,
    CatalogDep,
    ControlDep,
    RouterDep,
    SettingsDep,
    TrafficDep,
    require_admin,
)
from hub.api.times import UTCDateTime
from hub.api.traffic_models import CanaryPublic, ReadoutPublic
from hub.control import Control
from hub.errors import NotFound
from hub.routing import Router
from hub.routing.assignment import Arm
from hub.traffic.readout import build_readout
from hub.traffic.service import TrafficService
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
    updated_at: UTCDateTime | None
    canary: CanaryPublic | None


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


def _canary(doc: dict[str, Any] | None) -> CanaryPublic | None:
    return None if doc is None else CanaryPublic.model_validate(doc)


def _splits(
    router: Router, traffic: TrafficService, name: str, policy: TrafficPolicyView
) -> list[SplitPublic]:
    # Bucket shares only when this hub serves exactly this policy (not one a moment older).
    table = router.table(name) if traffic.policy(name) == policy else None
    shares = {a.label(name): s for a, s in table.shares().items()} if table is not None else {}
    out = []
    for split in policy.splits:
        label = Arm(split.model, split.version).label(name)
        share = round(shares.get(label, 0.0) * 100, 2) if table is not None else None
        out.append(SplitPublic(version=split.version, weight=split.weight, model=split.model,
                               label=label, bucket_share=share))  # fmt: skip
    return out


async def _public(
    control: Control, router: Router, traffic: TrafficService, name: str,
    policy: TrafficPolicyView,
) -> TrafficPublic:  # fmt: skip
    model = await control.model(name)
    latest = await traffic.canaries.status(name)
    running = latest if latest is not None and latest.state == "running" else None
    default = not any(s.weight > 0 for s in policy.splits)
    splits = _splits(router, traffic, name, policy)
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
        canary=_canary(traffic.canaries.describe(running)),
    )


@router.get("/{name}", response_model=TrafficPublic)
async def get_traffic(
    name: str, control: ControlDep, routes: RouterDep, traffic: TrafficDep
) -> TrafficPublic:
    """The effective policy: the stored split, or the default (100% to production/latest),
    with shadow, faults and a running canary."""
    policy = await control.traffic(name)
    return await _public(control, routes, traffic, name, policy)


@router.put("/{name}", response_model=TrafficPublic)
async def put_traffic(
    name: str,
    body: TrafficUpdate,
    control: ControlDep,
    routes: RouterDep,
    traffic: TrafficDep,
    actor: AdminActor,
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
    policy = await control.replace_traffic(name, splits, shadow=shadow, faults=faults, actor=actor)
    return await _public(control, routes, traffic, name, policy)


@router.delete("/{name}", response_model=TrafficPublic)
async def clear_traffic(
    name: str, control: ControlDep, routes: RouterDep, traffic: TrafficDep, actor: AdminActor
) -> TrafficPublic:
    """Back to the default: everything to production (else the latest), no shadow, no
    faults."""
    policy = await control.clear_traffic(name, actor=actor)
    return await _public(control, routes, traffic, name, policy)


@router.get("/{name}/readout", response_model=ReadoutPublic)
async def readout(
    name: str,
    catalog: CatalogDep,
    routes: RouterDep,
    traffic: TrafficDep,
    settings: SettingsDep,
) -> ReadoutPublic:
    """Per-version requests, errors, latency and tokens per second, a sample-ratio check and
    comparisons with the baseline; summed over every replica (`replicas` lists those that
    contributed)."""
    view = catalog.model(name)
    canary = await traffic.canaries.status(name)
    policy = traffic.policy(name)
    totals = await traffic.shared.totals(
        name, revisions=1, local_revision=policy.revision if policy is not None else 0
    )
    doc = build_readout(
        view,
        policy,
        routes.table(name),
        totals,
        traffic.stats,
        traffic.shadow,
        min_samples=settings.traffic.min_samples,
        canary=traffic.canaries.describe(canary),
    )
    return ReadoutPublic.model_validate(doc)


@router.post("/{name}/canary", status_code=201, response_model=CanaryPublic)
async def start_canary(
    name: str, body: CanaryCreate, traffic: TrafficDep, actor: AdminActor
) -> CanaryPublic:
    """Start an automated canary of `version` against production."""
    spec = CanarySpec(
        steps=tuple(body.steps),
        interval_s=body.interval,
        max_error_rate=body.max_error_rate,
        max_latency_ratio=body.max_latency_ratio,
        min_requests=body.min_requests,
    )
    canary = await traffic.canaries.start(name, body.version, spec, actor=actor)
    return CanaryPublic.model_validate(traffic.canaries.describe(canary))


@router.get("/{name}/canary", response_model=CanaryPublic)
async def canary_status(name: str, traffic: TrafficDep) -> CanaryPublic:
    """The running canary of `name`, else its most recent one."""
    doc = traffic.canaries.describe(await traffic.canaries.status(name))
    if doc is None:
        raise NotFound(f"{name} has never had a canary; start one with `hub canary start`")
    return CanaryPublic.model_validate(doc)


@router.post("/{name}/canary/abort", response_model=CanaryPublic)
async def abort_canary(
    name: str, traffic: TrafficDep, actor: AdminActor, body: CanaryAbort | None = None
) -> CanaryPublic:
    """Stop the running canary; all traffic back to the baseline."""
    reason = body.reason if body is not None else ""
    canary = await traffic.canaries.abort(name, actor=actor, reason=reason)
    return CanaryPublic.model_validate(traffic.canaries.describe(canary))
