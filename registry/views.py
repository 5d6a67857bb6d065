"""Plain, immutable views of registry rows: what leaves a database session."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class VersionView:
    name: str
    kind: str
    version: int
    source_uri: str
    mlflow_model_uri: str
    artifact_uri: str
    manifest: dict[str, str]
    total_bytes: int
    dtype: str
    runtime_config: dict[str, Any]
    status: str
    validation: dict[str, Any] | None
    eval_set: dict[str, Any] | None
    created_at: dt.datetime
    aliases: tuple[str, ...] = ()
    # A LoRA adapter's base version (`name@version`); None for a full model.
    base: BaseRef | None = None

    @property
    def is_adapter(self) -> bool:
        return self.base is not None


@dataclass(frozen=True, order=True)
class BaseRef:
    """The registered LLM version an adapter runs on."""

    name: str
    version: int

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class ModelView:
    name: str
    kind: str
    description: str
    created_at: dt.datetime
    updated_at: dt.datetime
    versions: dict[int, VersionView] = field(default_factory=dict)
    # alias -> version, as MLflow has them
    aliases: dict[str, int] = field(default_factory=dict)

    @property
    def latest(self) -> int | None:
        return max(self.versions) if self.versions else None

    def default_version(self) -> int | None:
        """What an unrouted request is served: the `production` alias, else the latest."""
        prod = self.aliases.get("production")
        if prod is not None and prod in self.versions:
            return prod
        return self.latest


@dataclass(frozen=True)
class EventView:
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


@dataclass(frozen=True)
class SplitView:
    """One version's share (percent) of a model's routed traffic. `model` is the model whose
    version serves it: the policy's own model, or another of the same kind."""

    model: str
    version: int
    weight: float


@dataclass(frozen=True)
class ShadowView:
    """Mirror `percent` of a model's requests to `model` v`version` (answers are compared,
    never returned)."""

    model: str
    version: int
    percent: float


@dataclass(frozen=True)
class FaultView:
    """Injected into requests served by `model` v`version`: a delay, then an error (503) for
    `error_percent` of them."""

    model: str
    version: int
    error_percent: float
    delay_ms: float = 0.0


@dataclass(frozen=True)
class TrafficPolicyView:
    """How a model's traffic is served. No splits means the default: everything to the
    `production` alias, else the latest version."""

    model: str
    splits: tuple[SplitView, ...] = ()
    shadow: ShadowView | None = None
    faults: tuple[FaultView, ...] = ()
    revision: int = 0
    updated_by: str = ""
    updated_at: dt.datetime | None = None


@dataclass(frozen=True)
class CanaryView:
    id: int
    model: str
    canary_version: int
    baseline_version: int
    steps: tuple[float, ...]
    step_index: int
    step_started_at: float
    interval_s: float
    max_error_rate: float
    max_latency_ratio: float
    min_requests: int
    state: str
    reason: str
    last_check: dict[str, Any] | None
    actor: str
    created_at: dt.datetime
    finished_at: dt.datetime | None

    @property
    def weight(self) -> float:
        """The canary's current share of traffic, percent (the last step's while promoting)."""
        return self.steps[min(self.step_index, len(self.steps) - 1)]


@dataclass(frozen=True)
class RegistrySnapshot:
    """Every model with its versions and aliases at one moment; what the router serves from."""

    models: dict[str, ModelView]
    # Stored traffic policies by model name; a model without one is served its default.
    traffic: dict[str, TrafficPolicyView] = field(default_factory=dict)

    def names(self) -> list[str]:
        return sorted(self.models)
