"""The native kernels' builds (backends/llm/native_build.py, setup.py): which variants exist
and which one a CPU runs, the install's build step, and the loader taking the built library
before it compiles anything. The module itself is torch-free: the variant choice runs in the
bare environment too (make test-pure)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backends.llm import native_build
from backends.llm.native_build import GENERIC, Variant

REPO_ROOT = Path(__file__).resolve().parents[3]
AVX512 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
AVX2 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
SSE4 = {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}


def needs_cc() -> None:
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler")


@pytest.mark.pure
def test_a_cpu_runs_the_levels_its_flags_allow_best_first() -> None:
    levels = native_build.cpu_levels
    assert levels(SSE4 | AVX2 | AVX512, "x86_64") == [
        "x86-64-v4",
        "x86-64-v3",
        "x86-64-v2",
        "x86-64",
    ]
    assert levels(SSE4 | AVX2, "x86_64") == ["x86-64-v3", "x86-64-v2", "x86-64"]
    # AVX-512 without AVX2's companions (bmi2 missing) is not v4, nor v3.
    assert levels(SSE4 | AVX512 | (AVX2 - {"bmi2"}), "x86_64") == ["x86-64-v2", "x86-64"]
    assert levels(set(), "x86_64") == ["x86-64"]  # any x86-64 CPU runs the baseline
    assert levels(set(), "aarch64") == [GENERIC]
    flags = native_build.cpu_flags("processor\t: 0\nflags\t\t: fpu sse4_2 avx2\n")
    assert {"sse4_2", "avx2"} <= flags


@pytest.mark.pure
def test_every_build_targets_a_fixed_level_with_the_baseline_among_them() -> None:
    """Never -march=native: a library built on one node must run on any other."""
    built = native_build.levels_built("x86_64")
    assert "x86-64" in built
    for level in built:
        flags = Variant(level, openmp=True).flags()
        assert f"-march={level}" in flags and "-fopenmp" in flags
        assert not any("native" in f for f in flags)
    assert not any(f.startswith("-march") for f in Variant(GENERIC, False).flags())


@pytest.mark.pure
def test_the_loader_takes_the_best_built_library_of_the_current_source(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def lib(level: str, openmp: bool, key: str | None = None) -> Path:
        path = native_build.library_path(tmp_path, "linear", Variant(level, openmp), key)
        path.touch()
        return path

    # An x86-64 CPU with AVX2 but no AVX-512, whatever machine runs the test.
    monkeypatch.setattr(native_build, "levels_built", lambda m=None: native_build.BUILT_X86_LEVELS)
    monkeypatch.setattr(native_build, "cpu_flags", lambda cpuinfo=None: SSE4 | AVX2)
    lib("x86-64-v4", True)  # this CPU has no AVX-512: never chosen
    base, v3, v3_serial = lib("x86-64", True), lib("x86-64-v3", True), lib("x86-64-v3", False)
    lib("x86-64-v3", True, key="0123456789abcdef")  # built from other sources: never chosen
    find = native_build.find_built
    assert find("linear", openmp=True, directory=tmp_path) == [v3, base, v3_serial]
    assert find("linear", openmp=False, directory=tmp_path) == [v3_serial]
    assert find("fused_decode", openmp=True, directory=tmp_path) == []


def test_a_build_keeps_what_is_current_and_drops_older_sources(tmp_path: Path) -> None:
    needs_cc()
    stale = native_build.library_path(
        tmp_path, "linear", Variant("x86-64", False), "0123456789abcdef"
    )
    tmp_path.mkdir(exist_ok=True)
    stale.write_bytes(b"old")
    level = native_build.cpu_levels(native_build.cpu_flags())[0]
    first = native_build.build_all(tmp_path, kernels=["linear"], levels=[level])
    assert first.built and not first.failed
    assert not stale.exists(), "a library of older sources is removed"
    stamps = {p: p.stat().st_mtime_ns for p in first.built}
    again = native_build.build_all(tmp_path, kernels=["linear"], levels=[level])
    assert {p: p.stat().st_mtime_ns for p in again.built} == stamps, "nothing rebuilt"
    nothing = native_build.build_all(tmp_path / "x", "no-such-compiler-here", kernels=["linear"])
    assert not nothing.built and "no-such-compiler-here" in nothing.failed[0]


def test_a_built_library_is_used_without_any_compiler(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What an installed image does: the library built at install, no compiler, nothing
    compiled into the kernel cache."""
    needs_cc()
    from backends.llm import cpu_kernels

    built = tmp_path / "built"
    level = native_build.cpu_levels(native_build.cpu_flags())[0]
    assert native_build.build_all(built, kernels=["paged_decode"], levels=[level]).built
    monkeypatch.setattr(native_build, "BUILT_DIR", built)
    cache = tmp_path / "cache"
    settings = cpu_kernels.KernelSettings(cache_dir=cache, compiler="no-such-compiler-here")
    kernel = cpu_kernels.load_paged_decode(
        openmp=cpu_kernels.torch_uses_gnu_openmp(), settings=settings
    )
    assert kernel.path.parent == built and f"-{level}" in kernel.path.name
    assert not cache.exists(), "nothing compiled"
    report = {r.kernel: r for r in native_build.kernel_reports()}["paged_decode"]
    assert (report.state, report.library, report.slow_path) == ("built", str(kernel.path), False)


@pytest.mark.slow
def test_the_install_build_step_puts_every_variant_in_the_package(tmp_path: Path) -> None:
    """setup.py's `build_kernels` (what `pip install` runs) fills `backends/llm/_native` of
    the package it builds; `native_build check` finds nothing missing there."""
    needs_cc()
    build_lib = tmp_path / "lib"
    command = [sys.executable, "setup.py", "-q", "build_kernels", "--build-lib", str(build_lib)]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    native = build_lib / "backends" / "llm" / "_native"
    gnu = native_build.is_gnu([os.environ.get("CC") or "cc"])
    assert native_build.missing(native, openmp=gnu) == []
    assert len(list(native.glob("*.so"))) == len(native_build.KERNELS) * len(
        native_build.levels_built()
    ) * (2 if gnu else 1)


def test_an_install_without_a_compiler_succeeds_and_says_so(tmp_path: Path) -> None:
    command = [sys.executable, "setup.py", "-q", "build_kernels", "--build-lib", str(tmp_path)]
    env = os.environ | {"CC": "no-such-compiler-here"}
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert "WARNING: no native CPU kernel was built" in result.stderr
    assert not list(tmp_path.rglob("*.so"))
