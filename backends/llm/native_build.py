"""The native CPU kernels' builds: the variants compiled at install, where they are kept, the
one this CPU runs, and what each kernel ended up running on (`kernel_reports`).

Installing the package (`pip install .` or `pip install -e .`: setup.py's `build_kernels`
step) compiles every kernel in `csrc/` once per variant into `BUILT_DIR`. A variant is an
instruction-set level and a threading model: on x86-64 the baseline `x86-64` (every x86-64
CPU), `x86-64-v3` (AVX2, FMA) and `x86-64-v4` (AVX-512), each with OpenMP (where the compiler
is GCC: the library then runs on the GNU OpenMP runtime torch has loaded) and without; other
architectures get the compiler's default target. A library's name carries a hash of its
source and headers, so a library built from other sources (an edited checkout) is never
loaded; `find_built` picks the best level this CPU's flags allow.

Standard library only, no torch: setup.py loads this file by path before anything is
installed. `python -m backends.llm.native_build build` (what `make` runs when a C source
changes) rebuilds into the package, `... check` fails unless every variant of this machine is
there (the Docker image's build stage runs it).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
# Where the install puts the built libraries (inside the package, beside `csrc/`).
BUILT_DIR = Path(__file__).with_name("_native")
KERNELS = ("paged_decode", "linear", "fused_decode")
GENERIC = "generic"
# x86-64 micro-architecture levels, best first, each with the /proc/cpuinfo flags it needs
# beyond the next one's (the psABI's definitions); the last runs on every x86-64 CPU.
X86_LEVELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("x86-64-v4", ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")),
    ("x86-64-v3", ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")),
    ("x86-64-v2", ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3")),
    ("x86-64", ()),
)
# The levels built: v2 adds nothing the kernels' 8-wide vectors use over the baseline.
BUILT_X86_LEVELS = ("x86-64-v4", "x86-64-v3", "x86-64")
# What each status a kernel entry point returns means (csrc/check.h's `hub_status`).
NO_MEMORY = 1
STATUS_MESSAGES = {
    2: "a size is out of range",
    3: "the rows asked for are not rows of the batch",
    4: "a context length is < 1 or longer than the kernel was sized for",
    5: "a row's blocks reach outside its block table",
    6: "a block id is outside the KV cache",
    7: "a token id is outside the vocabulary",
    8: "a cache slot is outside the KV cache",
    9: "a position is outside the rotary tables",
    10: "a sample row is not a row of the step",
    11: "the step needs more scratch than it was given",
}


def status_message(status: int) -> str:
    """What a kernel's nonzero status means, for an exception's message."""
    if status == NO_MEMORY:
        return "no memory for its scratch buffers"
    return STATUS_MESSAGES.get(status, f"unknown status {status}")


@dataclass(frozen=True)
class Variant:
    """One build of a kernel: an instruction-set level (`-march`), with OpenMP or without."""

    level: str
    openmp: bool

    @property
    def name(self) -> str:
        return self.level + ("-omp" if self.openmp else "")

    def flags(self) -> list[str]:
        march = [] if self.level == GENERIC else [f"-march={self.level}"]
        # -Wno-psabi: the baseline passes 32-byte vectors between static functions (no ABI).
        openmp = ["-fopenmp"] if self.openmp else []
        return ["-O3", *march, *openmp, "-fPIC", "-shared", "-Wno-psabi"]


def source_key(source: Path) -> str:
    """A hash of `source` and the headers beside it (what its quoted includes can name)."""
    code = b"\0".join(p.read_bytes() for p in [source, *sorted(source.parent.glob("*.h"))])
    return hashlib.sha256(code).hexdigest()[:16]


def library_path(directory: Path, kernel: str, variant: Variant, key: str | None = None) -> Path:
    key = key or source_key(CSRC / f"{kernel}.c")
    return directory / f"{kernel}-{key}-{variant.name}.so"


def levels_built(machine: str | None = None) -> tuple[str, ...]:
    """The levels the install builds for `machine` (this one's by default)."""
    machine = (machine or platform.machine()).lower()
    return BUILT_X86_LEVELS if machine in ("x86_64", "amd64") else (GENERIC,)


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The instruction-set flags of `/proc/cpuinfo` (empty where it cannot be read)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def cpu_levels(flags: set[str], machine: str | None = None) -> list[str]:
    """The levels a CPU with `flags` runs, best first: on x86-64 each level whose flags (and
    every lower level's) it has, ending with the baseline; elsewhere the generic build."""
    if levels_built(machine) == (GENERIC,):
        return [GENERIC]
    runs = []
    for i, (level, _) in enumerate(X86_LEVELS):
        if all(set(needed) <= flags for _, needed in X86_LEVELS[i:]):
            runs.append(level)
    return runs


def find_built(kernel: str, *, openmp: bool, directory: Path | None = None) -> list[Path]:
    """The built libraries of `kernel` this CPU can run, best first, for the source as it is
    now: with OpenMP (where `openmp`) before without, a higher level before a lower one."""
    directory = directory or BUILT_DIR
    key = source_key(CSRC / f"{kernel}.c")
    levels = cpu_levels(cpu_flags())
    found = []
    for threaded in (True, False) if openmp else (False,):
        for level in levels:
            path = library_path(directory, kernel, Variant(level, threaded), key)
            if path.is_file():
                found.append(path)
    return found


def is_gnu(compiler: list[str]) -> bool:
    """Whether `compiler` is GCC (its `--version` names the foundation)."""
    return "Free Software Foundation" in compiler_identity(compiler)


def compiler_identity(compiler: list[str]) -> str:
    """The compiler's `--version` text. RuntimeError where it cannot be run."""
    if not compiler or shutil.which(compiler[0]) is None:
        raise RuntimeError(f"no C compiler {shlex.join(compiler)!r} on PATH")
    try:
        result = subprocess.run(
            [*compiler, "--version"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"cannot run the C compiler {shlex.join(compiler)!r}: {e}") from e
    return result.stdout


def compile_library(compiler: list[str], flags: list[str], source: Path, target: Path) -> None:
    """Compile `source` into the shared library `target`, written whole or not at all
    (built beside it and renamed: processes building at once never see half a file).
    RuntimeError with the compiler's last line of complaint on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [*compiler, *flags, "-o", tmp, str(source), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["failed"])[-1]
            raise RuntimeError(
                f"{shlex.join([*compiler, *flags])} could not build {source.name}: {last}"
            )
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep other users out
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@dataclass
class BuildResult:
    built: list[Path] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def build_all(
    directory: Path | None = None,
    compiler: str = "cc",
    *,
    kernels: Iterable[str] = KERNELS,
    levels: Iterable[str] | None = None,
    jobs: int | None = None,
) -> BuildResult:
    """Build every variant of `kernels` for `levels` (this machine's by default) into
    `directory` (`BUILT_DIR`), keeping libraries already built from the same source and
    removing those built from older ones. A variant that fails is listed, not raised: the
    others still serve. A missing compiler fails every variant."""
    directory = directory or BUILT_DIR
    result = BuildResult()
    command = shlex.split(compiler)
    try:
        openmp = (True, False) if is_gnu(command) else (False,)
    except RuntimeError as e:
        result.failed.append(str(e))
        return result
    variants = [Variant(level, t) for level in levels or levels_built() for t in openmp]
    jobs_todo: list[tuple[Path, Variant, Path]] = []
    for kernel in kernels:
        source = CSRC / f"{kernel}.c"
        key = source_key(source)
        for old in directory.glob(f"{kernel}-*.so"):
            if old.name.split("-")[1] != key:
                old.unlink(missing_ok=True)
        for variant in variants:
            target = library_path(directory, kernel, variant, key)
            if target.is_file():
                result.built.append(target)
            else:
                jobs_todo.append((source, variant, target))

    def build(job: tuple[Path, Variant, Path]) -> str | None:
        source, variant, target = job
        try:
            compile_library(command, variant.flags(), source, target)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            return f"{target.name}: {e}"
        return None

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        for job, error in zip(jobs_todo, pool.map(build, jobs_todo), strict=True):
            if error is None:
                result.built.append(job[2])
            else:
                result.failed.append(error)
    return result


def missing(directory: Path | None = None, *, openmp: bool = True) -> list[str]:
    """Names of this machine's variants not built in `directory` for the current sources
    (OpenMP ones too where `openmp`)."""
    directory = directory or BUILT_DIR
    threading = (True, False) if openmp else (False,)
    return [
        library_path(directory, kernel, Variant(level, t)).name
        for kernel in KERNELS
        for level in levels_built()
        for t in threading
        if not library_path(directory, kernel, Variant(level, t)).is_file()
    ]


# ---- what each kernel runs on, for logs and `/admin/devices` ---------------------------------


@dataclass(frozen=True)
class KernelReport:
    """How one kernel is served in this process.

    state: "built" (the library the install built), "compiled" (compiled at first use into
    the kernel cache: a source checkout), "off" (switched off by the settings),
    "unavailable" (no library loads: the engine runs its slower torch path), or
    "not loaded" (no model has asked for it yet)."""

    kernel: str
    state: str
    library: str | None = None
    reason: str | None = None

    @property
    def slow_path(self) -> bool:
        return self.state == "unavailable"


_reports: dict[str, KernelReport] = {}


def record(report: KernelReport) -> None:
    _reports[report.kernel] = report


def kernel_reports() -> list[KernelReport]:
    """Every kernel's latest report in this process, "not loaded" where none was asked for."""
    return [_reports.get(k, KernelReport(k, "not loaded")) for k in KERNELS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backends.llm.native_build")
    parser.add_argument("command", choices=("build", "check"))
    parser.add_argument("--dir", type=Path, default=None, help=f"default {BUILT_DIR}")
    parser.add_argument("--cc", default=os.environ.get("CC") or "cc")
    args = parser.parse_args(argv)
    if args.command == "build":
        result = build_all(args.dir, args.cc)
        for error in result.failed:
            print(f"native kernels: {error}", file=sys.stderr)
        print(f"native kernels: {len(result.built)} built in {args.dir or BUILT_DIR}")
        return 0 if result.built and not result.failed else 1
    absent = missing(args.dir)
    for name in absent:
        print(f"native kernels: {name} is not built", file=sys.stderr)
    return 1 if absent else 0


if __name__ == "__main__":
    sys.exit(main())
