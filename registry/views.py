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
class RegistrySnapshot:
    """Every model with its versions and aliases at one moment; what the router serves from."""

    models: dict[str, ModelView]

    def names(self) -> list[str]:
        return sorted(self.models)
