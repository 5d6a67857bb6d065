"""API keys with policies: models, limits, priority, expiry; the generation every change moves."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from registry.db import Database, upgrade
from registry.errors import ConflictError, NotFoundError
from registry.keys import ApiKeys, KeyLimits, ModelLimits, hash_key


@pytest.fixture
def keys(tmp_path: Path) -> ApiKeys:
    url = f"sqlite:///{tmp_path / 'hub.db'}"
    upgrade(url)
    return ApiKeys(Database(url))


def test_a_key_carries_its_policy(keys: ApiKeys) -> None:
    limits = KeyLimits(requests_per_minute=60, max_concurrent=2)
    key, view = keys.create(
        "team-a", "user", models=["chat", "embed@2", "chat"], limits=limits, priority="batch"
    )
    assert view.policy.models == ("chat", "embed@2")
    policy = keys.verify(key)
    assert policy is not None and policy.name == "team-a" and policy.role == "user"
    assert policy.limits == limits and policy.priority == "batch"
    assert policy.models == ("chat", "embed@2")
    assert keys.get("team-a").policy == policy


def test_update_changes_only_what_it_names_and_none_clears(keys: ApiKeys) -> None:
    key, _ = keys.create("team-a", "user", models=["chat"], limits=KeyLimits(tokens_per_day=9))
    keys.update("team-a", priority="interactive")
    policy = keys.verify(key)
    assert policy is not None and policy.models == ("chat",) and policy.priority == "interactive"
    keys.update("team-a", models=None, limits=None)
    policy = keys.verify(key)
    assert policy is not None and policy.models is None and policy.limits is None


def test_expired_and_revoked_keys_are_invalid(keys: ApiKeys) -> None:
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    key, _ = keys.create("old", "user", expires_at=past)
    assert keys.verify(key) is None
    keys.update("old", expires_at=None)
    assert keys.verify(key) is not None
    keys.revoke("old")
    assert keys.verify(key) is None
    assert keys.get("old").revoked_at is not None


def test_every_change_moves_the_generation(keys: ApiKeys) -> None:
    seen = [keys.generation()]
    keys.create("a", "user")
    seen.append(keys.generation())
    keys.update("a", priority="batch")
    seen.append(keys.generation())
    keys.revoke("a")
    seen.append(keys.generation())
    assert len(set(seen)) == 4
    keys.list()
    keys.get("a")
    assert keys.generation() == seen[-1]


def test_bad_fields_are_refused_with_what_is_expected(keys: ApiKeys) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        KeyLimits(requests_per_minute=0)
    with pytest.raises(ValueError, match="unknown limit"):
        KeyLimits.from_json({"requests_per_hour": 5})
    with pytest.raises(ValueError, match="priority"):
        keys.create("a", "user", priority="urgent")
    with pytest.raises(ValueError, match="models"):
        keys.create("a", "user", models=["chat@"])
    with pytest.raises(ValueError, match="models"):
        keys.create("a", "user", models=[])
    with pytest.raises(ValueError, match="key name"):
        keys.create("a/b", "user")
    keys.create("a", "user")
    with pytest.raises(ConflictError):
        keys.create("a", "admin")
    with pytest.raises(NotFoundError):
        keys.update("nobody", priority="batch")


def test_a_key_made_before_the_migration_keeps_working_without_limits(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'hub.db'}"
    upgrade(url, "0006")
    engine = create_engine(url)
    with engine.begin() as c:
        c.execute(
            text(
                "INSERT INTO hub_api_keys (name, key_hash, prefix, role, created_at) "
                "VALUES ('legacy', :h, 'hub-legacy', 'user', CURRENT_TIMESTAMP)"
            ),
            {"h": hash_key("hub-legacy-key")},
        )
    engine.dispose()
    upgrade(url)
    policy = ApiKeys(Database(url)).verify("hub-legacy-key")
    assert policy is not None and policy.name == "legacy"
    assert policy.models is None and policy.limits is None and policy.priority == "standard"


def test_per_model_limits_are_stored_with_the_keys_and_old_limits_still_read(
    keys: ApiKeys,
) -> None:
    limits = KeyLimits(
        requests_per_minute=600,
        models={"chat": ModelLimits(tokens_per_minute=1000, max_concurrent=2)},
    )
    key, _ = keys.create("team-a", "user", limits=limits)
    policy = keys.verify(key)
    assert policy is not None and policy.limits == limits
    assert policy.limits.models["chat"].tokens_per_minute == 1000
    # Limits stored before per-model limits existed (no `models`) read as before.
    with keys.db.session() as s:
        s.execute(text("UPDATE hub_api_keys SET limits = '{\"tokens_per_day\": 9}'"))
    policy = keys.verify(key)
    assert policy is not None and policy.limits == KeyLimits(tokens_per_day=9)
    assert dict(policy.limits.models) == {}


def test_per_model_limits_name_a_model_and_some_limit() -> None:
    with pytest.raises(ValueError, match=r"limits.models.chat@2: .* use 'chat'"):
        KeyLimits.from_json({"models": {"chat@2": {"tokens_per_minute": 5}}})
    with pytest.raises(ValueError, match=r"limits.models.chat.tokens_per_minute must be"):
        KeyLimits.from_json({"models": {"chat": {"tokens_per_minute": 0}}})
    with pytest.raises(ValueError, match=r"unknown limit per_hour in limits.models.chat"):
        KeyLimits.from_json({"models": {"chat": {"per_hour": 5}}})
    with pytest.raises(ValueError, match=r"limits.models.chat sets no limit"):
        KeyLimits.from_json({"models": {"chat": {}}})
