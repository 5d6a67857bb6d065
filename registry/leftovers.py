"""What an interrupted registration left in MLflow, found and removed.

A registration writes in this order (`MlflowStore.log_version`, then `Registry.register`): a
run tagged `hub.model` with the model's files as artifacts, the registered model (when new),
a model version of the run, and last the SQL row. A process killed between two steps leaves

- a run with artifacts but no SQL version (with or without an MLflow version of it), and
- a registered model with no versions (created, then killed before its first version).

`remove_leftovers` deletes them once older than a grace period (a registration still in
progress, here or in another replica, is younger): the run's artifacts, its MLflow versions
and the run itself; an empty model the hub created (tagged `hub.managed`, or named by one of
the hub's runs) that SQL has no versions of. Each removal is logged, and recorded in the audit
log when SQL knows the model. Run it under the registration lock (registry.db
REGISTRATION_LOCK) where several replicas share the stores.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sqlalchemy import select

from registry.db import Database
from registry.mlflow_store import ARTIFACT_SUBDIR, MlflowStore
from registry.schema import AliasEvent, ModelVersion, RegisteredModel

log = logging.getLogger(__name__)

ACTOR = "hub:cleanup"


@dataclass(frozen=True)
class Leftover:
    """One thing removed: the model it belonged to and what it was."""

    model: str
    detail: str


def remove_leftovers(
    db: Database, mlflow: MlflowStore, *, grace: float, now: float | None = None
) -> list[Leftover]:
    """Remove what interrupted registrations left that is older than `grace` seconds (by
    MLflow's timestamps, against `now`, default the clock); returns what was removed."""
    cutoff_ms = ((now if now is not None else time.time()) - grace) * 1000
    with db.session() as s:
        rows = s.execute(
            select(RegisteredModel.id, RegisteredModel.name, ModelVersion.artifact_uri).outerjoin(
                ModelVersion
            )
        ).all()
    model_ids = {name: model_id for model_id, name, _ in rows}
    known_artifacts = {uri.rstrip("/") for _, _, uri in rows if uri}
    with_versions = {name for _, name, uri in rows if uri}

    removed: list[Leftover] = []
    run_models: set[str] = set()
    for run in mlflow.hub_runs():
        run_models.add(run.model)
        files = f"{run.artifact_uri.rstrip('/')}/{ARTIFACT_SUBDIR}"
        if run.start_ms > cutoff_ms or files in known_artifacts:
            continue
        versions = mlflow.versions_of_run(run.run_id)
        for name, version in versions:
            mlflow.delete_version(name, version)
        mlflow.delete_run(run.run_id)
        also = f" and its MLflow version(s) {sorted(v for _, v in versions)}" if versions else ""
        removed.append(Leftover(run.model, f"run {run.run_id} with its artifacts{also}"))
    for name, created_ms in mlflow.empty_models(run_models):
        if created_ms > cutoff_ms or name in with_versions:
            continue
        mlflow.delete_model(name)
        removed.append(Leftover(name, "registered model with no versions"))
    for item in removed:
        log.warning(
            "removed what an interrupted registration of %s left in MLflow: %s",
            item.model,
            item.detail,
        )
    _record(db, model_ids, removed)
    return removed


def _record(db: Database, model_ids: dict[str, int], removed: list[Leftover]) -> None:
    """An audit event per removal of a model SQL knows (others have no audit log)."""
    events = [
        AliasEvent(
            model_id=model_ids[item.model],
            alias="",
            action="cleanup",
            version=None,
            from_version=None,
            actor=ACTOR,
            reason=f"removed what an interrupted registration left in MLflow: {item.detail}",
        )
        for item in removed
        if item.model in model_ids
    ]
    if events:
        with db.session() as s:
            s.add_all(events)
