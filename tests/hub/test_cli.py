"""The `hub` command line against the registry: migrate, register, list, keys. No hub listens at
the configured address, so the registry commands work locally (tests/hub/test_cli_remote.py
has them against a running hub)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from benchmarks.launch.process import free_port
from hub.cli import app

runner = CliRunner()


@pytest.fixture
def config(tmp_path: Path, mlflow_template: Path) -> Path:
    import shutil

    shutil.copy(mlflow_template, tmp_path / "mlflow.db")
    path = tmp_path / "hub.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "database_url": f"sqlite:///{tmp_path / 'hub.db'}",
                "mlflow_tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                "cache_dir": str(tmp_path / "cache"),
                "port": free_port(),  # nothing listens there
            }
        )
    )
    return path


def test_db_upgrade_and_current(config: Path) -> None:
    from alembic.script import ScriptDirectory

    from registry.db import alembic_config

    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    result = runner.invoke(app, ["db", "upgrade", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert f"revision {head}" in result.output
    assert runner.invoke(app, ["db", "current", "--config", str(config)]).output.strip() == head


def test_register_versions_events(config: Path, tiny_embedder_dir: Path) -> None:
    args = ["register", "--name", "emb", "--kind", "embedder", "--source", str(tiny_embedder_dir)]
    result = runner.invoke(app, [*args, "--alias", "production", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert "no hub answers at http://127.0.0.1:" in result.stderr
    assert "working on the registry locally" in result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"name": "emb", "version": 1}
    out = runner.invoke(app, ["versions", "emb", "--config", str(config)]).output
    assert "v1" in out and "production" in out
    out = runner.invoke(app, ["events", "--config", str(config)]).output
    assert "emb production set - -> 1" in out


def test_register_refusal_exits_nonzero(config: Path, tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        ["register", "--name", "x", "--kind", "embedder", "--source", str(tmp_path / "missing"),
         "--config", str(config)],
    )  # fmt: skip
    assert result.exit_code == 1
    assert "does not exist" in result.output


def test_keys_create_list_revoke(config: Path) -> None:
    created = runner.invoke(
        app, ["keys", "create", "ops", "--role", "admin", "--config", str(config)]
    )
    key = created.output.strip()
    assert created.exit_code == 0 and key.startswith("hub-")
    listing = runner.invoke(app, ["keys", "list", "--config", str(config)]).output
    assert "ops" in listing and key not in listing  # only a prefix is ever shown
    assert runner.invoke(app, ["keys", "revoke", "ops", "--config", str(config)]).exit_code == 0
    assert "revoked" in runner.invoke(app, ["keys", "list", "--config", str(config)]).output


def last_json(output: str) -> dict:
    """The JSON document a command printed last (progress bars may precede it)."""
    return json.loads(output[output.rindex("\n{") + 1 :] if "\n{" in output else output)


def test_promote_and_rollback_validate_locally(config: Path, tiny_embedder_dir: Path) -> None:
    def hub(*args: str) -> Any:
        return runner.invoke(app, [*args, "--config", str(config)])

    for _ in range(2):
        source = str(tiny_embedder_dir)
        assert (
            hub("register", "--name", "emb", "--kind", "embedder", "--source", source).exit_code
            == 0
        )
    refused = hub("promote", "emb", "1", "--to", "production")
    assert refused.exit_code == 1 and "has not passed staging" in refused.output
    for version, to in ((1, "staging"), (1, "production"), (2, "staging"), (2, "production")):
        result = hub("promote", "emb", str(version), "--to", to, "--reason", "cli")
        assert result.exit_code == 0, result.output
        assert last_json(result.stdout)["validation"]["passed"] is True
    result = hub("rollback", "emb")
    assert result.exit_code == 0, result.output
    rolled = last_json(result.stdout)
    assert (rolled["version"], rolled["from_version"]) == (1, 2)
    assert "production rollback 2 -> 1" in hub("events", "emb").output


def test_register_hf_source_uses_the_configured_hf_cache(
    config: Path, tiny_embedder_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`hub register hf://...` reads `registry.hf_cache_dir` as the app does (it was ignored:
    the CLI wired its own registry)."""
    from tests.registry.test_sources import fake_hf_cache

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf-cache"
    fake_hf_cache(cache, "acme/tiny-embedder", tiny_embedder_dir)
    doc = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**doc, "registry": {"hf_cache_dir": str(cache)}}))
    result = runner.invoke(
        app,
        ["register", "--name", "emb", "--kind", "embedder", "--source", "hf://acme/tiny-embedder",
         "--config", str(config)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1]) == {"name": "emb", "version": 1}
    out = runner.invoke(app, ["versions", "emb", "--config", str(config)]).output
    assert "hf://acme/tiny-embedder" in out


def test_register_an_adapter_with_base(config: Path, tiny_llm_dir: Path, tmp_path: Path) -> None:
    from tests.backends.llm.lora_support import ATTENTION, build_adapter

    adapter = str(build_adapter(tiny_llm_dir, tmp_path / "adapter", ATTENTION))
    base = ["register", "--name", "tiny", "--kind", "llm", "--source", str(tiny_llm_dir)]
    result = runner.invoke(app, [*base, "--alias", "production", "--config", str(config)])
    assert result.exit_code == 0, result.output
    bot = [
        "register",
        "--name",
        "bot",
        "--kind",
        "llm",
        "--source",
        adapter,
        "--config",
        str(config),
    ]
    result = runner.invoke(app, bot)
    assert result.exit_code == 1 and '"base"' in result.output  # an adapter needs its base
    result = runner.invoke(app, [*bot, "--base", "tiny@production"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1]) == {"name": "bot", "version": 1}
    out = runner.invoke(app, ["versions", "bot", "--config", str(config)]).output
    assert "(adapter on tiny@1)" in out


def test_keys_carry_a_policy_on_the_database(config: Path) -> None:
    def hub(*args: str) -> Any:
        return runner.invoke(app, ["keys", *args, "--config", str(config)])

    expiry = "2999-01-01T00:00:00+00:00"
    created = hub("create", "team-a", "--model", "chat", "--model", "emb@2",
                  "--limit", "tokens_per_day=1000", "--model-limit", "chat:tokens_per_minute=100",
                  "--model-limit", "chat:max_concurrent=2", "--expires-at", expiry)  # fmt: skip
    assert created.exit_code == 0, created.output
    shown = json.loads(hub("show", "team-a").output)
    assert shown["models"] == ["chat", "emb@2"]
    assert shown["limits"] == {
        "tokens_per_day": 1000, "models": {"chat": {"tokens_per_minute": 100, "max_concurrent": 2}}
    }  # fmt: skip
    assert "chat:tokens_per_minute=100" in hub("list").output
    assert shown["expires_at"].startswith("2999-01-01")
    assert hub("update", "team-a", "--priority", "interactive").exit_code == 0
    assert "priority=interactive" in hub("list").output
    refused = hub("update", "team-a", "--limit", "requests_per_hour=5")
    assert refused.exit_code == 1 and "unknown limit" in refused.output
    refused = hub("update", "team-a", "--model-limit", "chat@2:max_concurrent=1")
    assert refused.exit_code == 1 and "use 'chat'" in refused.output
    assert hub("update", "team-a", "--model-limit", "tokens_per_minute=5").exit_code == 2
    assert hub("update", "team-a").exit_code == 2  # nothing to change
