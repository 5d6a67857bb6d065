"""Settings: YAML plus HUB_ overrides; unknown keys and bad values fail naming key and file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hub.settings import SettingsError, load_settings


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hub.yaml"
    path.write_text(text)
    return path


def test_yaml_values_and_units(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "devices: [{name: cpu, memory_budget: 2GiB}, {name: 'cuda:0', memory_budget: 80%}]\n"
        "host_cache_budget: 512MiB\nmanager: {load_timeout: 5m, keep_alive: -1}\n",
    )
    s = load_settings(path)
    assert s.devices[0].memory_budget == 2 * 2**30
    assert s.devices[1].memory_budget == pytest.approx(0.8)
    assert s.host_cache_budget == 512 * 2**20
    assert s.manager.load_timeout == 300
    assert s.manager.keep_alive == -1


def test_environment_overrides_single_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "port: 8001\nmanager: {load_timeout: 30s}\n")
    monkeypatch.setenv("HUB_PORT", "9000")
    monkeypatch.setenv("HUB_MANAGER__KEEP_ALIVE", "10m")
    s = load_settings(path)
    assert s.port == 9000
    assert s.manager.keep_alive == 600
    assert s.manager.load_timeout == 30  # the file's value survives a sibling override


def test_unknown_key_names_key_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, "databse_url: sqlite:///x.db\n")
    with pytest.raises(SettingsError) as e:
        load_settings(path)
    assert "databse_url" in str(e.value) and str(path) in str(e.value)
    assert "database_url" in str(e.value)  # the known keys are listed


def test_bad_nested_value_names_the_key(tmp_path: Path) -> None:
    path = write(tmp_path, "devices: [{name: gpu0, memory_budget: 1GiB}]\n")
    with pytest.raises(SettingsError, match=r"devices\.0\.name.*'cpu' or 'cuda:N'"):
        load_settings(path)


def test_bad_environment_value_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HUB_PORT", "eighty")
    with pytest.raises(SettingsError, match="environment variable HUB_PORT"):
        load_settings(write(tmp_path, "{}\n"))


def test_unknown_environment_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HUB_PROT", "9000")
    with pytest.raises(SettingsError, match=r"HUB_PROT \(did you mean HUB_PORT\?\)"):
        load_settings(None)


def test_client_variables_are_accepted_and_not_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CLI's own variables (README, `hub models --help`) share the prefix.
    monkeypatch.setenv("HUB_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("HUB_API_KEY", "hub-secret")
    s = load_settings(write(tmp_path, "port: 8001\n"))
    assert s.port == 8001 and s.host == "127.0.0.1"
    assert "hub-secret" not in repr(s.model_dump())


def test_a_misspelt_client_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HUB_API_KYE", "hub-secret")
    with pytest.raises(SettingsError, match=r"HUB_API_KYE \(did you mean HUB_API_KEY\?\)"):
        load_settings(None)


def test_cli_exits_2_on_bad_settings(tmp_path: Path) -> None:
    path = write(tmp_path, "log_level: loud\n")
    proc = subprocess.run(
        [sys.executable, "-m", "hub.cli", "db", "upgrade", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 2
    assert "log_level" in proc.stderr and str(path) in proc.stderr


def test_cli_runs_with_the_client_variables_exported(tmp_path: Path) -> None:
    path = write(tmp_path, f"database_url: sqlite:///{tmp_path / 'hub.db'}\n")
    env = {**os.environ, "HUB_URL": "http://127.0.0.1:9", "HUB_API_KEY": "hub-secret"}
    env.pop("HUB_CONFIG", None)
    for args in (["db", "upgrade", "--config", str(path)], ["serve", "--help"]):
        proc = subprocess.run(
            [sys.executable, "-m", "hub.cli", *args],
            capture_output=True, text=True, timeout=120, env=env,
            cwd=Path(__file__).resolve().parents[2],
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert "unknown setting" not in proc.stderr
