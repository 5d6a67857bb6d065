"""Registry snapshots built in memory, for testing the catalog and the router without SQL or
MLflow: `SnapshotSource` stands in for the registry behind a `Catalog`."""

from __future__ import annotations

import datetime as dt

from registry.views import ModelView, RegistrySnapshot, TrafficPolicyView, VersionView

EPOCH = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def model_view(
    name: str, kind: str = "embedder", versions: int = 1, aliases: dict[str, int] | None = None
) -> ModelView:
    """`name` with versions 1..`versions` and the given aliases."""
    views = {v: _version(name, kind, v) for v in range(1, versions + 1)}
    return ModelView(name, kind, "", EPOCH, EPOCH, views, dict(aliases or {}))


def _version(name: str, kind: str, v: int) -> VersionView:
    return VersionView(
        name=name, kind=kind, version=v, source_uri=f"/models/{name}/{v}",
        mlflow_model_uri=f"models:/{name}/{v}", artifact_uri=f"file:///{name}/{v}",
        manifest={}, total_bytes=0, dtype="float32", runtime_config={}, status="registered",
        validation=None, eval_set=None, created_at=EPOCH,
    )  # fmt: skip


def snapshot(
    *models: ModelView, traffic: list[TrafficPolicyView] | None = None
) -> RegistrySnapshot:
    return RegistrySnapshot(
        models={m.name: m for m in models}, traffic={p.model: p for p in traffic or []}
    )


class SnapshotSource:
    """What a Catalog reads from (`snapshot()`), holding whatever the test last set."""

    def __init__(self, current: RegistrySnapshot | None = None) -> None:
        self.current = current or RegistrySnapshot(models={})
        self.reads = 0

    def snapshot(self) -> RegistrySnapshot:
        self.reads += 1
        return self.current
