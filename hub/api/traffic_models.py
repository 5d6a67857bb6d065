"""Response models of the readout and canary routes (hub.api.traffic).

Statistical test results (`sample_ratio`, a comparison's `error_rate` and `latency`, a
canary check) stay open objects: each test names its own figures (see
hub.traffic.significance)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class CanaryPublic(BaseModel):
    id: int
    model: str
    version: int
    baseline_version: int
    state: str = Field(description="running, promoted, rolled_back or aborted")
    reason: str
    steps: list[float]
    step_index: int
    weight: float = Field(description="the canary's current share of traffic, percent")
    promoting: bool = Field(description="every step passed; the promotion is under way")
    step_started_at: float
    interval_s: float
    max_error_rate: float
    max_latency_ratio: float
    min_requests: int
    started_by: str
    created_at: str
    finished_at: str | None
    last_check: dict[str, Any] | None
    observation: dict[str, Any] | None = Field(
        description="this process's latest analysis of the running step"
    )


class LatencyMs(BaseModel):
    p50: float | None
    p95: float | None
    p99: float | None


class ReadoutVersion(BaseModel):
    version: str = Field(description='as X-Hub-Model-Version names it: "3" or "other@3"')
    weight: float
    bucket_share: float | None
    requests: int
    routed: int
    errors: int
    error_rate: float | None
    latency_ms: LatencyMs
    tokens: int
    tokens_per_second: float | None


class ReadoutComparison(BaseModel):
    version: str
    baseline: str
    error_rate: dict[str, Any]
    latency: dict[str, Any]


class ShadowTarget(BaseModel):
    version: str
    percent: float


class ShadowSimilarity(BaseModel):
    mean: float | None
    min: float | None
    compared: int


class ShadowVersion(BaseModel):
    version: str
    mirrored: int
    errors: int
    last_error: str | None
    outcomes: dict[str, int]
    similarity: ShadowSimilarity
    latency_ms: LatencyMs
    primary_latency_ms: LatencyMs
    latency_ratio_p50: float | None


class ShadowReadout(BaseModel):
    target: ShadowTarget | None
    queued: int
    versions: list[ShadowVersion]


class ReadoutPublic(BaseModel):
    model: str
    kind: str
    scope: str
    # Replicas whose traffic the numbers add up.
    replicas: list[str]
    window_truncated: bool
    policy_revision: int
    versions: list[ReadoutVersion]
    sample_ratio: dict[str, Any]
    baseline: str | None
    comparisons: list[ReadoutComparison]
    shadow: ShadowReadout | None
    canary: CanaryPublic | None
