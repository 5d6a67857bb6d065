"""The LLM engine's kernel switches are hub settings (`engine:`, `HUB_ENGINE__*`), with the
old `MODEL_HUB_*` / `CC` variables read as defaults by the settings alone, and they reach the
backend at load: without a library built at install, the kernels are compiled where
`engine.kernel_cache_dir` says, and not at all with `engine.cpu_kernels: false`;
`/admin/devices` says which."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from backends.llm import native_build
from backends.llm.kernel_settings import KernelSettings
from hub.app import create_app
from hub.settings import SettingsError, load_settings
from tests.support.hubs import make_settings


@pytest.fixture(autouse=True)
def _no_engine_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MODEL_HUB_CPU_KERNELS", "MODEL_HUB_KERNEL_CACHE", "CC", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)


def test_engine_settings_come_from_the_file_then_hub_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert load_settings().engine.kernel_settings() == KernelSettings()
    path = tmp_path / "hub.yaml"
    engine = {"cpu_kernels": False, "kernel_cache_dir": str(tmp_path / "k"), "cc": "gcc -O1"}
    path.write_text(yaml.safe_dump({"engine": engine}))
    assert load_settings(path).engine.kernel_settings() == KernelSettings(
        enabled=False, cache_dir=tmp_path / "k", compiler="gcc -O1"
    )
    monkeypatch.setenv("HUB_ENGINE__CPU_KERNELS", "true")
    monkeypatch.setenv("HUB_ENGINE__CC", "clang")
    settings = load_settings(path).engine
    assert (settings.cpu_kernels, settings.cc) == (True, "clang")
    path.write_text(yaml.safe_dump({"engine": {"cpu_kernel": False}}))
    with pytest.raises(SettingsError, match=r"engine\.cpu_kernel"):
        load_settings(path)


def test_the_old_variables_are_defaults_read_by_the_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MODEL_HUB_CPU_KERNELS", "0")
    monkeypatch.setenv("MODEL_HUB_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "ccache gcc")
    assert load_settings().engine.kernel_settings() == KernelSettings(
        enabled=False, cache_dir=tmp_path / "cache", compiler="ccache gcc"
    )
    monkeypatch.setenv("HUB_ENGINE__CPU_KERNELS", "1")  # the hub's own variable wins
    assert load_settings().engine.cpu_kernels is True
    monkeypatch.delenv("MODEL_HUB_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert load_settings().engine.kernel_cache_dir == tmp_path / "xdg" / "model-hub" / "kernels"


def generate_once(
    tmp_path: Path, mlflow_template: Path, folder: Path, engine: dict
) -> dict[str, dict]:
    """Generate once on a fresh hub; `/admin/devices`'s kernel rows after, by kernel."""
    settings = make_settings(tmp_path / "hub", mlflow_template, engine=engine)
    with TestClient(create_app(settings)) as client:
        body = {"name": "tiny", "kind": "llm", "source": str(folder),
                "config": {"kv_cache_bytes": "4MiB", "dtype": "float32"}}  # fmt: skip
        assert client.post("/admin/registry/models", json=body).status_code == 201
        generate = {"model": "tiny", "prompt": "the gulls", "max_tokens": 4, "temperature": 0}
        r = client.post("/v1/completions", json=generate)
        assert r.status_code == 200, r.text
        return {k["kernel"]: k for k in client.get("/admin/devices").json()["kernels"]}


def test_the_kernel_settings_reach_the_engine_at_load(
    tmp_path: Path, mlflow_template: Path, tiny_llm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler 'cc': the native decode kernel cannot be built")
    # No library built at install (a source checkout): compiled on first use.
    monkeypatch.setattr(native_build, "BUILT_DIR", tmp_path / "not-built")
    off = tmp_path / "off"
    off.mkdir()
    kernels = generate_once(tmp_path / "a", mlflow_template, tiny_llm_dir,
                            {"cpu_kernels": False, "kernel_cache_dir": str(off)})  # fmt: skip
    assert not list(off.iterdir()), "switched off: nothing is built"
    assert kernels["fused_decode"]["state"] == kernels["linear"]["state"] == "off"
    on = tmp_path / "on"
    engine = {"cpu_kernels": True, "kernel_cache_dir": str(on), "cc": "cc"}
    kernels = generate_once(tmp_path / "b", mlflow_template, tiny_llm_dir, engine)
    for name in ("fused_decode", "linear"):
        assert kernels[name]["state"] == "compiled" and not kernels[name]["slow_path"]
        assert kernels[name]["library"].startswith(str(on))
    # The tiny Llama's steps run fused (the decode attention kernel is built on the first step
    # through transformers, which this one request never needs).
    built = {p.name.split("-")[0] for p in on.glob("*.so")}
    assert {"fused_decode", "linear"} <= built, "the kernels are built in the configured folder"


def test_with_no_library_and_no_compiler_the_devices_say_slow_path(
    tmp_path: Path, mlflow_template: Path, tiny_llm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native_build, "BUILT_DIR", tmp_path / "not-built")
    engine = {"kernel_cache_dir": str(tmp_path / "cache"), "cc": "no-such-compiler-here"}
    kernels = generate_once(tmp_path / "a", mlflow_template, tiny_llm_dir, engine)
    fused = kernels["fused_decode"]
    assert (fused["state"], fused["slow_path"]) == ("unavailable", True)
    assert "no-such-compiler-here" in fused["reason"]
