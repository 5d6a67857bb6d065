"""Drift between MLflow and the hub's SQL metadata, found and repaired or reported.

Aliases: MLflow's are authoritative (they are what is served). An alias whose MLflow value
differs from the last audit event (moved in the MLflow UI or API, or a hub write that failed
half-way) is repaired by recording the observed state as a `sync` event. Versions: a version
known to only one side cannot be repaired automatically (a SQL row needs the verified
manifest) and is reported.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select

from registry.aliases import AliasBook
from registry.db import Database
from registry.mlflow_store import MlflowStore
from registry.schema import ModelVersion, RegisteredModel


@dataclass(frozen=True)
class Drift:
    model: str
    kind: str  # "alias" | "version"
    detail: str
    repaired: bool


def find_drift(
    db: Database, mlflow: MlflowStore, aliases: AliasBook, *, versions: bool, repair: bool
) -> list[Drift]:
    """Compare both stores; with `repair`, record alias drift as audit events."""
    found: list[Drift] = []
    in_mlflow = mlflow.all_aliases()
    with db.session() as s:
        models = s.execute(select(RegisteredModel.id, RegisteredModel.name)).all()
        sql_versions: dict[str, set[int]] = {name: set() for _, name in models}
        for name, version in s.execute(
            select(RegisteredModel.name, ModelVersion.version).join(ModelVersion)
        ):
            sql_versions[name].add(version)
    for _, name in models:
        if name not in in_mlflow:
            found.append(Drift(name, "version", "registered in SQL but missing in MLflow", False))
            continue
        actual = in_mlflow[name]
        recorded = aliases.recorded(name)
        for alias in sorted(set(actual) | set(recorded)):
            if actual.get(alias) == recorded.get(alias):
                continue
            # A difference seen without the lock may be a move in progress: confirm under it.
            confirmed = aliases.confirm_drift(name, alias, repair=repair)
            if confirmed is not None:
                now, was = confirmed
                detail = f"{alias}: MLflow has {_v(now)}, the audit log has {_v(was)}"
                found.append(Drift(name, "alias", detail, repair))
        if versions:
            in_ml = mlflow.version_numbers(name)
            for v in sorted(in_ml - sql_versions[name]):
                found.append(Drift(name, "version", f"v{v} exists in MLflow only", False))
            for v in sorted(sql_versions[name] - in_ml):
                found.append(Drift(name, "version", f"v{v} exists in SQL only", False))
    return found


def _v(version: int | None) -> str:
    return "none" if version is None else f"v{version}"
