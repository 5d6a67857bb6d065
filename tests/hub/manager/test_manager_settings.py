"""The manager's settings keys: parsed with units, refused with the key named when wrong."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hub.manager.deployment import Deployment, DeploymentError
from hub.settings import ModelSpec, SettingsError, load_settings


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hub.yaml"
    path.write_text(text)
    return path


def test_manager_keys_with_units(tmp_path: Path) -> None:
    s = load_settings(
        write(
            tmp_path,
            "manager: {eviction_policy: largest, min_residency: 250ms, "
            "load_overhead_bytes: 64MiB, idle_check_interval: 2s}\n"
            "models: [{name: m, kind: llm, source: x, keep_alive: 10m, device: cpu, pin: true}]\n",
        )
    )
    assert s.manager.eviction_policy == "largest"
    assert s.manager.min_residency == 0.25 and s.manager.idle_check_interval == 2
    assert s.manager.load_overhead_bytes == 64 * 2**20
    assert (s.models[0].keep_alive, s.models[0].device, s.models[0].pin) == (600, "cpu", True)
    defaults = load_settings(write(tmp_path, "{}\n")).manager
    assert (defaults.eviction_policy, defaults.min_residency) == ("gdsf", 1.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("manager: {eviction_policy: fifo}\n", "manager.eviction_policy"),
        ("manager: {min_residency: -1}\n", "manager.min_residency"),
        ("manager: {idle_check_interval: 0}\n", "manager.idle_check_interval"),
        ("manager: {evict_policy: lru}\n", "unknown key 'manager.evict_policy'"),
        (
            "models: [{name: m, kind: llm, source: x, device: 'cuda:3'}]\n",
            "asks for device 'cuda:3', which is not in devices (cpu)",
        ),
    ],
)
def test_bad_manager_settings_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(message)):
        load_settings(write(tmp_path, text))


def test_deployment_layers_runtime_config_over_the_settings() -> None:
    spec = ModelSpec(name="m", kind="llm", source="x", keep_alive=60, device="cpu")
    assert Deployment.resolve({}, spec, ["cpu"]) == Deployment("cpu", 60.0, False)
    assert Deployment.resolve({"keep_alive": "-1", "pin": True}, spec, ["cpu"]) == Deployment(
        "cpu", -1.0, True
    )
    with pytest.raises(DeploymentError, match="keep_alive"):
        Deployment.resolve({"keep_alive": "soon"}, None, ["cpu"])
    with pytest.raises(DeploymentError, match="pin: Input should be a valid boolean"):
        Deployment.resolve({"pin": "yes"}, None, ["cpu"])
