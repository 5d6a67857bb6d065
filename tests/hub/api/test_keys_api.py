"""API keys through the admin API: created with a policy (the key shown once), listed, read,
changed and revoked; bad input a 400 in OpenAI's error shape, unknown 404, duplicate 409."""

from __future__ import annotations

from pathlib import Path

from tests.support.hubs import ADMIN, auth_settings, running_app


async def test_keys_are_managed_through_the_admin_api(
    tmp_path: Path, mlflow_template: Path
) -> None:
    settings, user_key = auth_settings(tmp_path / "hub", mlflow_template)
    user = {"Authorization": f"Bearer {user_key}"}
    async with running_app(settings) as (_, client):
        body = {
            "name": "team-a",
            "role": "user",
            "models": ["chat", "emb@2"],
            "limits": {
                "requests_per_minute": 60,
                "max_concurrent": 4,
                "models": {"chat": {"tokens_per_minute": 1000}},
            },
            "priority": "batch",
            "expires_at": "2999-01-01T00:00:00Z",
        }
        assert (await client.post("/admin/keys", json=body)).status_code == 401
        assert (await client.post("/admin/keys", json=body, headers=user)).status_code == 403
        r = await client.post("/admin/keys", json=body, headers=ADMIN)
        assert r.status_code == 201, r.text
        created = r.json()
        key = created.pop("key")
        assert key.startswith(created["prefix"]) and created["revoked_at"] is None
        unset = {"requests_per_minute": None, "tokens_per_minute": None, "tokens_per_day": None,
                 "max_concurrent": None}  # fmt: skip
        assert created["limits"] == {
            **unset, "requests_per_minute": 60, "max_concurrent": 4,
            "models": {"chat": {**unset, "tokens_per_minute": 1000}},
        }  # fmt: skip
        assert created["models"] == ["chat", "emb@2"] and created["priority"] == "batch"
        # The key itself is never shown again.
        listed = (await client.get("/admin/keys", headers=ADMIN)).json()
        assert [k["name"] for k in listed] == ["app", "team-a"]
        assert all("key" not in k for k in listed)
        assert (await client.get("/admin/keys/team-a", headers=ADMIN)).json() == created
        team = {"Authorization": f"Bearer {key}"}
        assert (await client.get("/v1/models", headers=team)).status_code == 200

        r = await client.post("/admin/keys", json={"name": "team-a", "role": "user"}, headers=ADMIN)
        assert r.status_code == 409
        r = await client.patch(
            "/admin/keys/team-a", json={"models": None, "priority": "interactive"}, headers=ADMIN
        )
        assert r.status_code == 200, r.text
        assert r.json()["models"] is None and r.json()["priority"] == "interactive"
        assert r.json()["limits"]["requests_per_minute"] == 60  # untouched
        # New limits replace the old ones whole, the per-model ones included.
        limits = {"models": {"emb": {"requests_per_minute": 6000}}}
        r = await client.patch("/admin/keys/team-a", json={"limits": limits}, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert r.json()["limits"] == {
            **unset,
            "models": {"emb": {**unset, "requests_per_minute": 6000}},
        }
        shown = (await client.get("/admin/keys/team-a", headers=ADMIN)).json()
        assert shown["limits"] == r.json()["limits"]

        r = await client.delete("/admin/keys/team-a", headers=ADMIN)
        assert r.status_code == 200 and r.json()["revoked_at"] is not None
        r = await client.get("/v1/models", headers=team)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for method in ("GET", "PATCH", "DELETE"):
            r = await client.request(method, "/admin/keys/nobody", json={}, headers=ADMIN)
            assert r.status_code == 404, (method, r.text)


async def test_bad_key_bodies_are_400_naming_the_field(
    tmp_path: Path, mlflow_template: Path
) -> None:
    settings, _ = auth_settings(tmp_path / "hub", mlflow_template)
    async with running_app(settings) as (_, client):
        cases = [
            ({"name": "a/b", "role": "user"}, "name"),
            ({"name": "a", "role": "root"}, "role"),
            ({"name": "a", "role": "user", "priority": "urgent"}, "priority"),
            ({"name": "a", "role": "user", "limits": {"requests_per_minute": 0}}, "limits"),
            ({"name": "a", "role": "user", "limits": {"requests_per_hour": 5}}, "limits"),
            ({"name": "a", "role": "user", "models": []}, "models"),
            # Per-model limits: by registered name, the same four fields, each set positive.
            (
                {
                    "name": "a",
                    "role": "user",
                    "limits": {"models": {"chat@2": {"max_concurrent": 1}}},
                },
                "limits.models",
            ),
            (
                {"name": "a", "role": "user", "limits": {"models": {"chat": {"per_hour": 1}}}},
                "limits.models.chat.per_hour",
            ),
            (
                {
                    "name": "a",
                    "role": "user",
                    "limits": {"models": {"chat": {"max_concurrent": 0}}},
                },
                "limits.models.chat.max_concurrent",
            ),
            ({"name": "a", "role": "user", "limits": {"models": {"chat": {}}}}, "limits.models"),
            ({"name": "a", "role": "user", "limits": {"models": ["chat"]}}, "limits.models"),
            ({"name": "a", "role": "user", "models": ["chat@"]}, "models"),
            ({"name": "a", "role": "user", "expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
            ({"name": "a", "role": "user", "budget": 5}, "budget"),
        ]
        for body, field in cases:
            r = await client.post("/admin/keys", json=body, headers=ADMIN)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and field in error["message"], error
        r = await client.patch("/admin/keys/app", json={"role": None}, headers=ADMIN)
        assert r.status_code == 400 and "role" in r.json()["error"]["message"]
        assert (await client.get("/admin/keys", headers=ADMIN)).json()[0]["name"] == "app"
