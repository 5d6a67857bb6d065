"""Verified local copies of model versions.

A version is materialised into `cache_dir/<name>/<version>`: downloaded from MLflow into a
temporary folder, every file checked against the version's sha256 manifest, then renamed into
place in one step, so a reader never sees a half-written or unverified copy. Several hub
processes may share the cache: whichever renames first wins and the others use its copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path

from registry.errors import IntegrityError
from registry.mlflow_store import MlflowStore
from registry.sources import model_files, sha256_file

MARKER = ".hub-verified"

log = logging.getLogger(__name__)


def manifest_digest(manifest: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(dict(manifest), sort_keys=True).encode()).hexdigest()


def verify(folder: Path, manifest: Mapping[str, str]) -> None:
    """Raise IntegrityError unless `folder` holds exactly the manifest's files and hashes."""
    present = {p.relative_to(folder).as_posix() for p in model_files(folder)}
    missing = sorted(set(manifest) - present)
    if missing:
        raise IntegrityError(f"{folder}: files missing from the copy: {missing[:5]}")
    for rel, expected in manifest.items():
        actual = sha256_file(folder / rel)
        if actual != expected:
            raise IntegrityError(
                f"{folder / rel}: sha256 {actual[:12]}... does not match the registered "
                f"{expected[:12]}..."
            )


class ArtifactCache:
    def __init__(self, cache_dir: Path, mlflow: MlflowStore) -> None:
        self.cache_dir = cache_dir
        self.mlflow = mlflow
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def path(self, name: str, version: int) -> Path:
        return self.cache_dir / name / str(version)

    def _lock(self, key: tuple[str, int]) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())

    def is_ready(self, name: str, version: int, manifest: Mapping[str, str]) -> bool:
        marker = self.path(name, version) / MARKER
        return marker.is_file() and marker.read_text().strip() == manifest_digest(manifest)

    def materialise(
        self, name: str, version: int, artifact_uri: str, manifest: Mapping[str, str]
    ) -> Path:
        """The verified local folder of a version, downloading it on first use."""
        final = self.path(name, version)
        with self._lock((name, version)):
            if self.is_ready(name, version, manifest):
                return final
            if final.exists():
                log.warning("discarding unverified cache copy %s", final)
                shutil.rmtree(final, ignore_errors=True)
            staging = self.cache_dir / ".staging" / f"{name}-{version}-{uuid.uuid4().hex[:8]}"
            staging.mkdir(parents=True)
            try:
                downloaded = self.mlflow.download(artifact_uri, staging)
                verify(downloaded, manifest)
                (downloaded / MARKER).write_text(manifest_digest(manifest))
                final.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.rename(downloaded, final)
                except OSError:
                    # Another process renamed its verified copy first; use that one.
                    if not self.is_ready(name, version, manifest):
                        raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            log.info("materialised %s v%d into %s", name, version, final)
            return final

    def evict(self, name: str, version: int) -> None:
        shutil.rmtree(self.path(name, version), ignore_errors=True)
