"""API keys: admin paths need an admin key, inference a user key, when auth is enabled."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from hub.app import create_app
from registry.db import Database, upgrade
from registry.keys import ApiKeys
from tests.support.hubs import make_settings


def test_keys_guard_admin_and_inference(tmp_path: Path, mlflow_template: Path) -> None:
    settings = make_settings(
        tmp_path / "hub", mlflow_template,
        auth={"enabled": True, "bootstrap_admin_key": "boot-secret"},
    )  # fmt: skip
    upgrade(settings.database_url)
    keys = ApiKeys(Database(settings.database_url))
    user_key, _ = keys.create("app", "user")
    admin_key, _ = keys.create("ops", "admin")
    with TestClient(create_app(settings)) as client:
        assert client.get("/health/ready").status_code == 200  # probes stay open
        r = client.get("/v1/models")
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert (
            client.get("/v1/models", headers={"Authorization": f"Bearer {user_key}"}).status_code
            == 200
        )
        r = client.get("/admin/models", headers={"Authorization": f"Bearer {user_key}"})
        assert r.status_code == 403
        assert client.get("/admin/models", headers={"X-API-Key": admin_key}).status_code == 200
        assert (
            client.get("/admin/models", headers={"Authorization": "Bearer boot-secret"}).status_code
            == 200
        )
    keys.revoke("app")
    with TestClient(create_app(settings)) as client:
        r = client.get("/v1/models", headers={"Authorization": f"Bearer {user_key}"})
        assert r.status_code == 401
