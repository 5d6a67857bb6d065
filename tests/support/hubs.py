"""Building hub settings and apps for tests: every hub gets its own databases, MLflow store
and cache under a temp folder. Migrating MLflow's schema costs seconds and the hub's a tenth
of one, and most tests start a hub: migrated empty databases of both are made once per
session and copied."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from hub.app import create_app
from hub.settings import HubSettings


def make_settings(root: Path, mlflow_template: Path | None = None, **overrides: Any) -> HubSettings:
    """Settings for a hub under `root`; with `mlflow_template` (`make_mlflow_template`), its
    MLflow database and, unless `database_url` is overridden, its hub database start as
    copies of the migrated templates."""
    root.mkdir(parents=True, exist_ok=True)
    mlflow_db, hub_db = root / "mlflow.db", root / "hub.db"
    if mlflow_template is not None and not mlflow_db.exists():
        shutil.copy(mlflow_template, mlflow_db)
        hub_template = mlflow_template.with_name(HUB_TEMPLATE)
        if "database_url" not in overrides and hub_template.exists() and not hub_db.exists():
            shutil.copy(hub_template, hub_db)
    values: dict[str, Any] = {
        "database_url": f"sqlite:///{hub_db}",
        "mlflow_tracking_uri": f"sqlite:///{mlflow_db}",
        "cache_dir": root / "cache",
        "demo_dir": root / "demo",
        "devices": [{"name": "cpu", "memory_budget": "2GiB"}],
        "host_cache_budget": "1GiB",
        "registry": {"poll_interval": 0.5},
    }
    values.update(overrides)
    return HubSettings(**values)


# The bootstrap admin key of `auth_settings`, and its header.
BOOTSTRAP_ADMIN_KEY = "boot-secret"
ADMIN = {"Authorization": f"Bearer {BOOTSTRAP_ADMIN_KEY}"}


async def admin_register(
    client: httpx.AsyncClient, name: str, kind: str, source: Path, **extra: Any
) -> None:
    """Register `source` as a new version of `name` with the bootstrap admin's key."""
    body = {"name": name, "kind": kind, "source": str(source), **extra}
    r = await client.post("/admin/registry/models", json=body, headers=ADMIN)
    assert r.status_code == 201, r.text


def auth_settings(root: Path, mlflow_template: Path | None = None) -> tuple[HubSettings, str]:
    """Settings with API keys required (`BOOTSTRAP_ADMIN_KEY` the bootstrap admin's) over a
    migrated database that holds one user key, "app"; returned with that key."""
    from registry.db import Database, upgrade
    from registry.keys import ApiKeys

    settings = make_settings(
        root, mlflow_template, auth={"enabled": True, "bootstrap_admin_key": BOOTSTRAP_ADMIN_KEY}
    )
    upgrade(settings.database_url)
    user_key, _ = ApiKeys(Database(settings.database_url)).create("app", "user")
    return settings, user_key


HUB_TEMPLATE = "hub-template.db"


def make_mlflow_template(folder: Path) -> Path:
    """A migrated, empty MLflow database, with a migrated, empty hub database beside it
    (`HUB_TEMPLATE`), made in a child process so the files are complete."""
    db = folder / "mlflow-template.db"
    code = (
        f"from registry.mlflow_store import MlflowStore; MlflowStore('sqlite:///{db}').ping(); "
        f"from registry.db import upgrade; upgrade('sqlite:///{folder / HUB_TEMPLATE}')"
    )
    repo = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
    }
    subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, timeout=120, env=env
    )
    return db


@contextlib.asynccontextmanager
async def running_app(settings: HubSettings) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """The app with its lifespan run, and an async client talking to it in-process."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://hub") as client:
            yield app, client
