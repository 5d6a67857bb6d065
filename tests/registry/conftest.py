from __future__ import annotations

from pathlib import Path

import pytest

from registry.cache import ArtifactCache
from registry.db import Database, upgrade
from registry.mlflow_store import MlflowStore
from registry.service import Registry
from tests.support.hubs import make_settings


@pytest.fixture
def registry(tmp_path: Path, mlflow_template: Path) -> Registry:
    settings = make_settings(tmp_path / "hub", mlflow_template)
    upgrade(settings.database_url)
    mlflow = MlflowStore(settings.mlflow_tracking_uri)
    return Registry(
        Database(settings.database_url), mlflow, ArtifactCache(settings.cache_dir, mlflow)
    )
