"""The MLflow side of the registry: artifacts, model versions and aliases.

Embedded by default (a SQLite tracking store with a local artifact folder); an MLflow server
when the tracking URI is http(s). Nothing here touches the process-global MLflow state (the
tracking URI, the active run), so several stores (tests, replicas) can live in one process;
the one exception is the HTTP limits below.

MLflow's HTTP client reads its timeout and retry policy from `MLFLOW_HTTP_REQUEST_*`
variables at every call, with defaults (120 s, 7 retries with exponential backoff) that held
each call for minutes when the server was down. A store given `HttpLimits` (the hub passes
its `registry.mlflow_*` settings) writes them there before its first call: process-wide, the
only place MLflow takes them from.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from registry.db import sqlite_path
from registry.errors import NotFoundError, RegistryError

EXPERIMENT_NAME = "model-hub"
ARTIFACT_SUBDIR = "model"
# Tags the hub puts on its runs (the model's name) and on the registered models it creates.
MODEL_TAG = "hub.model"
MANAGED_TAG = "hub.managed"

log = logging.getLogger(__name__)


def default_artifact_location(tracking_uri: str) -> str | None:
    """Embedded MLflow keeps artifacts beside its database file; a server decides itself."""
    path = sqlite_path(tracking_uri)
    if path is None:
        return None
    return (path.resolve().parent / "mlartifacts").as_uri()


@dataclass(frozen=True)
class HubRun:
    """A run the hub made to hold a version's files."""

    run_id: str
    model: str
    artifact_uri: str
    start_ms: int


@dataclass(frozen=True)
class HttpLimits:
    """How long one MLflow HTTP request may wait (to connect, then per read) and how many
    times a failed one is retried (at most ~1 s apart)."""

    timeout_s: float = 10.0
    max_retries: int = 1

    def apply(self) -> None:
        # MLflow parses these as integers.
        os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(max(1, math.ceil(self.timeout_s)))
        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = str(self.max_retries)
        os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] = "1"
        os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_JITTER"] = "0.5"


class MlflowStore:
    def __init__(
        self,
        tracking_uri: str,
        artifact_location: str | None = None,
        *,
        limits: HttpLimits | None = None,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.artifact_location = artifact_location or default_artifact_location(tracking_uri)
        self.limits = limits
        self._client: Any = None
        self._experiment_id: str | None = None
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        """The MlflowClient; created on first use (it migrates an embedded database)."""
        with self._lock:
            if self._client is None:
                from mlflow import MlflowClient

                if self.limits is not None:
                    self.limits.apply()
                path = sqlite_path(self.tracking_uri)
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                self._client = MlflowClient(
                    tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri
                )
            return self._client

    def ping(self) -> None:
        self.client.search_registered_models(max_results=1)

    def _experiment(self) -> str:
        if self._experiment_id is None:
            exp = self.client.get_experiment_by_name(EXPERIMENT_NAME)
            if exp is not None:
                self._experiment_id = exp.experiment_id
            else:
                self._experiment_id = self.client.create_experiment(
                    EXPERIMENT_NAME, artifact_location=self.artifact_location
                )
        return self._experiment_id

    def log_version(
        self, name: str, folder: Path, *, description: str = "", tags: dict[str, str]
    ) -> tuple[int, str]:
        """Log `folder` as artifacts of a new run and create a model version from them.
        Returns (version number, artifact URI of the files)."""
        from mlflow.exceptions import MlflowException

        client = self.client
        run = client.create_run(self._experiment(), tags={MODEL_TAG: name, **tags})
        run_id = run.info.run_id
        try:
            client.log_artifacts(run_id, str(folder), ARTIFACT_SUBDIR)
            client.set_terminated(run_id)
        except Exception:
            client.set_terminated(run_id, status="FAILED")
            raise
        try:
            # Tagged: an interrupted registration's empty model is known as the hub's own.
            client.create_registered_model(
                name, description=description, tags={MANAGED_TAG: "true"}
            )
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        artifact_uri = f"{run.info.artifact_uri.rstrip('/')}/{ARTIFACT_SUBDIR}"
        mv = client.create_model_version(name, source=artifact_uri, run_id=run_id, tags=tags)
        return int(mv.version), artifact_uri

    def download(self, artifact_uri: str, dst: Path) -> Path:
        from mlflow.artifacts import download_artifacts

        if self.limits is not None:
            self.limits.apply()
        return Path(
            download_artifacts(
                artifact_uri=artifact_uri, dst_path=str(dst), tracking_uri=self.tracking_uri
            )
        )

    def delete_version(self, name: str, version: int) -> None:
        self.client.delete_model_version(name, str(version))

    def aliases(self, name: str) -> dict[str, int]:
        from mlflow.exceptions import MlflowException

        try:
            model = self.client.get_registered_model(name)
        except MlflowException as e:
            raise NotFoundError(f"MLflow has no registered model {name!r}") from e
        return {alias: int(v) for alias, v in (model.aliases or {}).items()}

    def all_aliases(self) -> dict[str, dict[str, int]]:
        """{model name: {alias: version}} for every registered model, paging through."""
        out: dict[str, dict[str, int]] = {}
        token = None
        while True:
            page = self.client.search_registered_models(max_results=500, page_token=token)
            for model in page:
                out[model.name] = {a: int(v) for a, v in (model.aliases or {}).items()}
            token = page.token
            if not token:
                return out

    def version_numbers(self, name: str) -> set[int]:
        """Every version number MLflow holds for `name`."""
        numbers: set[int] = set()
        token = None
        while True:
            page = self.client.search_model_versions(
                f"name = '{name}'", max_results=1000, page_token=token
            )
            numbers.update(int(mv.version) for mv in page)
            token = page.token
            if not token:
                return numbers

    def ensure_webhook(self, name: str, url: str, secret: str, events: tuple[str, ...]) -> None:
        """Create (or update) the webhook through which MLflow tells the hub of alias moves."""
        client = self.client
        existing = [w for w in client.list_webhooks() if w.name == name]
        if existing:
            client.update_webhook(
                existing[0].webhook_id, url=url, events=list(events), secret=secret,
                status="ACTIVE",
            )  # fmt: skip
        else:
            client.create_webhook(name=name, url=url, events=list(events), secret=secret)

    # ---- what interrupted registrations leave (registry.leftovers) --------------------------
    def hub_runs(self) -> list[HubRun]:
        """The hub's active runs (tagged with a model name), paging through."""
        out: list[HubRun] = []
        token = None
        while True:
            page = self.client.search_runs([self._experiment()], max_results=1000, page_token=token)
            for run in page:
                model = run.data.tags.get(MODEL_TAG)
                if model is not None:
                    info = run.info
                    out.append(HubRun(info.run_id, model, info.artifact_uri, info.start_time or 0))
            token = page.token
            if not token:
                return out

    def versions_of_run(self, run_id: str) -> list[tuple[str, int]]:
        """(model, version) of every MLflow model version made from run `run_id`."""
        found = self.client.search_model_versions(f"run_id = '{run_id}'")
        return [(mv.name, int(mv.version)) for mv in found]

    def delete_run(self, run_id: str) -> None:
        """Delete the run's artifacts (where the artifact store can), then the run."""
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        run = self.client.get_run(run_id)
        try:
            get_artifact_repository(run.info.artifact_uri).delete_artifacts()
        except Exception as e:  # a store without deletes: the run goes, its files stay
            log.warning("could not delete the artifacts of run %s: %s", run_id, e)
        self.client.delete_run(run_id)

    def empty_models(self, also: set[str]) -> list[tuple[str, int]]:
        """(name, creation time in ms) of registered models with no versions that the hub
        created: tagged MANAGED_TAG, or named in `also` (the models of the hub's runs)."""
        out = []
        token = None
        while True:
            page = self.client.search_registered_models(max_results=500, page_token=token)
            for model in page:
                ours = (model.tags or {}).get(MANAGED_TAG) == "true" or model.name in also
                # latest_versions comes with the page: only a model without any is asked.
                if ours and not model.latest_versions and not self.version_numbers(model.name):
                    out.append((model.name, model.creation_timestamp or 0))
            token = page.token
            if not token:
                return out

    def delete_model(self, name: str) -> None:
        self.client.delete_registered_model(name)

    def set_alias(self, name: str, alias: str, version: int) -> None:
        try:
            self.client.set_registered_model_alias(name, alias, str(version))
        except Exception as e:
            raise RegistryError(f"MLflow refused alias {alias!r} -> {name} v{version}: {e}") from e

    def delete_alias(self, name: str, alias: str) -> None:
        self.client.delete_registered_model_alias(name, alias)
