"""Revocation on every replica within about a second: two hubs over one database, a key
revoked (or narrowed) through one is refused by the other at its next generation read,
long before its cache of verified keys would expire; with SQL unreachable the cache serves."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import httpx
import pytest

import hub.auth
from hub.auth import Authenticator
from hub.errors import Unauthorized
from hub.settings import AuthSettings
from registry.db import Database, upgrade
from registry.errors import DependencyUnavailable
from registry.keys import ApiKeys
from tests.support.hubs import ADMIN, auth_settings, running_app

# Polls of replica B, 50 ms apart: a hang guard far beyond the second revocation takes.
POLLS = 600


async def _until(client: httpx.AsyncClient, path: str, headers: dict[str, str], status: int) -> int:
    """Poll `path` until it answers `status`; the number of polls it took."""
    for polls in range(1, POLLS + 1):
        if (await client.get(path, headers=headers)).status_code == status:
            return polls
        await asyncio.sleep(0.05)
    raise AssertionError(f"{path} never answered {status}")


async def test_a_revocation_through_one_replica_holds_on_the_other(
    tmp_path: Path, mlflow_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Verified keys stay cached for an hour: only the generation read can drop them.
    monkeypatch.setattr(hub.auth, "CACHE_SECONDS", 3600.0)
    settings, _ = auth_settings(tmp_path / "hub", mlflow_template)
    replicas = [
        settings.model_copy(update={"replica": settings.replica.model_copy(update={"id": i})})
        for i in ("a", "b")
    ]
    async with contextlib.AsyncExitStack() as stack:
        (_, a), (_, b) = [await stack.enter_async_context(running_app(s)) for s in replicas]
        r = await a.post("/admin/keys", json={"name": "ops", "role": "admin"}, headers=ADMIN)
        ops = {"Authorization": f"Bearer {r.json()['key']}"}
        r = await a.post("/admin/keys", json={"name": "app2", "role": "user"}, headers=ADMIN)
        user = {"Authorization": f"Bearer {r.json()['key']}"}
        # B verifies both keys, and caches them.
        assert (await b.get("/admin/keys", headers=ops)).status_code == 200
        assert (await b.get("/v1/models", headers=user)).status_code == 200

        # Narrowed through A: B answers 403 for the admin path.
        r = await a.patch("/admin/keys/ops", json={"role": "user"}, headers=ADMIN)
        assert r.status_code == 200
        await _until(b, "/admin/keys", ops, 403)
        # Revoked through A: B refuses the key.
        assert (await a.delete("/admin/keys/app2", headers=ADMIN)).status_code == 200
        await _until(b, "/v1/models", user, 401)
        r = await b.get("/v1/models", headers=user)
        assert r.json()["error"]["code"] == "invalid_api_key"


class _Outage(ApiKeys):
    """Keys whose database stops answering the generation read when `down` is set."""

    down = False

    def generation(self) -> int:
        if self.down:
            raise DependencyUnavailable("the registry database does not answer")
        return super().generation()


async def test_with_sql_down_the_cache_serves_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"sqlite:///{tmp_path / 'hub.db'}"
    upgrade(url)
    keys = _Outage(Database(url))
    key, _ = keys.create("app", "user")
    auth = Authenticator(AuthSettings(enabled=True), keys)
    try:
        await auth.poll_generation()
        assert (await auth.check(f"Bearer {key}", None, admin=False)).name == "app"
        keys.down = True
        with caplog.at_level(logging.WARNING, logger="hub.auth"):
            for _ in range(3):
                await auth.poll_generation()
        assert (await auth.check(f"Bearer {key}", None, admin=False)).name == "app"
        assert len([r for r in caplog.records if "generation" in r.getMessage()]) == 1
        # Back, and the revocation made meanwhile applies at the next read.
        keys.down = False
        keys.revoke("app")
        await auth.poll_generation()
        with pytest.raises(Unauthorized):
            await auth.check(f"Bearer {key}", None, admin=False)
    finally:
        auth.close()
