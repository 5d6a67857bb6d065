"""The `hub` command line against a running hub (the default): registry commands go through
its admin API at the configured address, so the hub sees what they did at once, and read
commands cost the CLI no MLflow import or migration."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from typer.testing import CliRunner, Result

from benchmarks.launch.process import REPO, free_port, hub_process
from hub.cli import app
from tests.hub.test_cli import last_json

pytestmark = pytest.mark.apart

runner = CliRunner()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, mlflow_template: Path) -> Iterator[Path]:
    """A running hub; yields its config file, whose host and port are the hub's."""
    root = tmp_path_factory.mktemp("cli-remote")
    shutil.copy(mlflow_template, root / "mlflow.db")
    port = free_port()
    config = root / "hub.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "database_url": f"sqlite:///{root / 'hub.db'}",
                "mlflow_tracking_uri": f"sqlite:///{root / 'mlflow.db'}",
                "cache_dir": str(root / "cache"),
                "devices": [{"name": "cpu", "memory_budget": "2GiB"}],
                "log_level": "warning",
                "port": port,
            }
        )
    )
    # `hub serve` runs with the client's variables exported too (a user's shell has them).
    client_env = {"HUB_URL": f"http://127.0.0.1:{port}", "HUB_API_KEY": "hub-unused"}
    with hub_process(config, cwd=root, port=port, env=client_env):
        yield config


def _hub(config: Path, *args: str) -> Result:
    result = runner.invoke(app, [*args, "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert "locally" not in result.stderr, result.stderr
    return result


def _base(config: Path) -> str:
    return f"http://127.0.0.1:{yaml.safe_load(config.read_text())['port']}"


def test_registry_commands_go_through_the_running_hub(
    served: Path, tiny_embedder_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A relative source folder is resolved here: the hub runs in another directory.
    shutil.copytree(tiny_embedder_dir, tmp_path / "emb")
    monkeypatch.chdir(tmp_path)
    for version in (1, 2):
        created = _hub(served, "register", "--name", "emb", "--kind", "embedder", "--source", "emb")
        assert json.loads(created.stdout.strip().splitlines()[-1]) == {
            "name": "emb",
            "version": version,
        }
    # The hub knows at once: its catalog was refreshed by its own register route.
    hub_view = httpx.get(f"{_base(served)}/admin/registry/models", timeout=30).json()
    assert [(m["name"], m["versions"]) for m in hub_view] == [("emb", [1, 2])]
    assert "emb" in _hub(served, "models").stdout
    for version, to in ((1, "staging"), (1, "production"), (2, "staging"), (2, "production")):
        promoted: Any = last_json(_hub(served, "promote", "emb", str(version), "--to", to).stdout)
        assert promoted["version"] == version and promoted["validation"]["passed"] is True
    rolled = last_json(_hub(served, "rollback", "emb", "--reason", "cli").stdout)
    assert (rolled["version"], rolled["from_version"]) == (1, 2)
    assert "production rollback 2 -> 1" in _hub(served, "events", "emb").stdout
    assert "v1" in _hub(served, "versions", "emb").stdout
    # Residency commands take the same default address.
    _hub(served, "pin", "emb", "1")
    status = json.loads(_hub(served, "status").stdout)
    pinned = [(m["name"], m["version"]) for m in status["models"] if m["pinned"]]
    assert pinned == [("emb", 1)]


def test_hub_url_names_the_hub_to_ask(
    served: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No config: the default address (port 8000) is not the hub's; $HUB_URL is.
    monkeypatch.delenv("HUB_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HUB_URL", _base(served))
    monkeypatch.setenv("HUB_API_KEY", "hub-unused")
    result = runner.invoke(app, ["events"])
    assert result.exit_code == 0, result.output
    assert "locally" not in result.stderr and "unknown setting" not in result.stderr
    assert not (tmp_path / ".hub").exists()  # nothing was created here: the hub answered


def test_a_read_command_imports_no_mlflow_and_migrates_nothing(served: Path) -> None:
    code = (
        "import sys\n"
        "from hub.cli import app\n"
        f"app(['models', '--config', {str(served)!r}], standalone_mode=False)\n"
        "heavy = [m for m in ('mlflow', 'sqlalchemy', 'alembic', 'torch') if m in sys.modules]\n"
        "print('heavy modules:', heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "heavy modules: []" in out.stdout, out.stdout + out.stderr
    assert "locally" not in out.stderr


def test_keys_commands_with_a_url_go_through_the_admin_api(served: Path) -> None:
    """`hub keys ... --url` manages keys on the running hub: what it creates, the hub lists,
    and the local database commands (no --url) see the same keys."""
    url = ["--url", _base(served)]
    created = _hub(served, "keys", "create", "team-a", "--model", "emb", "--limit",
                   "requests_per_minute=60", "--model-limit", "emb:max_concurrent=2",
                   "--priority", "batch", *url)  # fmt: skip
    secret = created.stdout.strip()
    assert secret.startswith("hub-")
    listed = httpx.get(f"{_base(served)}/admin/keys", timeout=30).json()
    assert [(k["name"], k["models"], k["priority"]) for k in listed] == [
        ("team-a", ["emb"], "batch")
    ]
    assert listed[0]["limits"]["models"]["emb"]["max_concurrent"] == 2
    assert "emb:max_concurrent=2" in _hub(served, "keys", "list", *url).stdout
    _hub(served, "keys", "update", "team-a", "--all-models", "--no-limits", *url)
    shown = json.loads(_hub(served, "keys", "show", "team-a", *url).stdout)
    assert shown["models"] is None and shown["limits"] is None
    assert "team-a" in _hub(served, "keys", "list").stdout  # the database, without --url
    assert "revoked team-a" in _hub(served, "keys", "revoke", "team-a", *url).stdout
    assert "revoked" in _hub(served, "keys", "list", *url).stdout


def test_hub_usage_reads_the_running_hubs_usage(served: Path, tiny_embedder_dir: Path) -> None:
    base = _base(served)
    body = {"name": "use-emb", "kind": "embedder", "source": str(tiny_embedder_dir)}
    assert httpx.post(f"{base}/admin/registry/models", json=body, timeout=60).status_code == 201
    told = 0
    for text in ("one", "two words"):
        r = httpx.post(f"{base}/v1/embeddings", json={"model": "use-emb", "input": [text]},
                       timeout=60)  # fmt: skip
        told += r.json()["usage"]["prompt_tokens"]
    [row] = json.loads(_hub(served, "usage", "--model", "use-emb", "--json").stdout)
    assert (row["key"], row["version"], row["requests"], row["prompt_tokens"]) == (
        "anonymous", 1, 2, told,
    )  # fmt: skip
    table = _hub(served, "usage", "--model", "use-emb", "--group-by", "model").stdout
    assert table.split("\n")[1].split()[:3] == ["use-emb", "2", "0"]
    refused = runner.invoke(app, ["usage", "--group-by", "colour", "--config", str(served)])
    assert refused.exit_code == 1 and "cannot group usage by 'colour'" in refused.output
