"""Native CPU kernels in C, called via ctypes: the decode attention kernel, and how every
kernel's library is found or built.

Decode attention on a CPU is bound by memory traffic: the whole context of every sequence is
read once per layer and step. Gathering a sequence's blocks into one tensor first (what plain
torch can do) copies that context and reads it twice more; `csrc/paged_decode.c` reads the
keys and values in place from the cache blocks instead.

Where the libraries come from (`load_native`): installing the package builds every kernel
for several instruction-set levels (`native_build`), and the best one this CPU runs is
loaded. Without one for the current sources (a source checkout never installed, or C
sources edited since), the kernel is compiled on first use with `KernelSettings.compiler`
(`cc` by default; arguments allowed) for this CPU (`-march=native`) and cached in
`KernelSettings.cache_dir` (default `~/.cache/model-hub/kernels`), keyed by the source, the
flags and the CPU, and reused by every later process. A failed compile is remembered there
(a `.failed` file beside where the library would be) so later processes do not retry it; a
different compiler or source gets a fresh attempt.

Where no library loads, or the kernels are switched off (`KernelSettings.enabled`),
`paged_decode(settings)` returns None and the engine keeps its torch path: a WARNING says so
once, and `native_build.kernel_reports()` (shown by `/admin/devices`) names the kernel as
unavailable with the reason. The hub fills the settings from its `engine:` section; this
module reads no environment variable.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import platform
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from backends.llm import native_build
from backends.llm.kernel_settings import KernelSettings

log = logging.getLogger(__name__)

CSRC = native_build.CSRC
SOURCE = CSRC / "paged_decode.c"
K = TypeVar("K")
# With OpenMP only where torch itself runs on GNU OpenMP: the library then links the
# `libgomp.so.1` torch has already loaded, and the decode rows go to torch's own idle (still
# spinning) OpenMP threads instead of a thread of ours competing with them. A second OpenMP
# runtime would fight torch's, so elsewhere the build is serial and the caller splits rows
# over threads. Without -march=native when the compiler refuses it.
_OPENMP_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"],
    ["-O3", "-fopenmp", "-fPIC", "-shared"],
)
_SERIAL_FLAG_SETS = (
    ["-O3", "-march=native", "-fPIC", "-shared"],
    ["-O3", "-fPIC", "-shared"],
)


class PagedDecodeKernel:
    """`csrc/paged_decode.c`'s `hub_paged_decode_f32` with the checks ctypes cannot make."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        fn = library.hub_paged_decode_f32
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64]
        fn.argtypes += [ctypes.c_float, ctypes.c_int, ptr]
        fn.restype = ctypes.c_int
        self._fn = fn  # ctypes releases the GIL for the call: threads can share a batch
        # True: one call spreads its rows over torch's OpenMP threads by itself.
        self.threaded = bool(library.hub_paged_decode_threaded())

    def __call__(
        self,
        queries: torch.Tensor,  # (B, KV, G, D) float32, scaled
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, KV, D) float32
        tables: torch.Tensor,  # every row's block ids, concatenated, int64
        table_starts: torch.Tensor,  # (B,) int64
        lens: torch.Tensor,  # (B,) int64
        out: torch.Tensor,  # (B, KV, G, D) float32, written
        *,
        rows: range | None = None,
        threads: int = 1,
        sliding_window: int | None,
        softcap: float | None,
        indices_checked: bool = False,
    ) -> None:
        """Rows `rows` (all by default) of `out`; `threads` is used by a threaded build.
        `indices_checked`: the caller has passed these tables through `check_indices` (once
        per step, not once per layer). The kernel checks every index it follows itself too:
        ValueError (`raise_for_status`) for one out of range, whoever checked before."""
        b, kv_heads, group, head_dim = queries.shape
        _, num_blocks, block_size, cache_kv, cache_dim = kv_cache.shape
        if (
            kv_cache.shape[0] != 2
            or (cache_kv, cache_dim) != (kv_heads, head_dim)
            or out.shape != queries.shape
        ):
            raise ValueError("paged decode: query, cache and output shapes disagree")
        for t in (queries, kv_cache, out):
            if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("paged decode needs contiguous float32 CPU tensors")
        for t in (tables, table_starts, lens):
            if t.dtype != torch.int64 or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("paged decode needs contiguous int64 tables and lengths")
        if len(table_starts) != b or len(lens) != b:
            raise ValueError("paged decode: one table start and length per row")
        rows = range(b) if rows is None else rows
        if rows.stop != b or rows.start < 0 or rows.step < 1:
            raise ValueError(f"paged decode: rows {rows} do not end at the batch size {b}")
        if not indices_checked:
            self.check_indices(tables, table_starts, lens, num_blocks, block_size)
        status = self._fn(
            queries.data_ptr(),
            kv_cache.data_ptr(),
            num_blocks,
            block_size,
            kv_heads,
            group,
            head_dim,
            tables.data_ptr(),
            len(tables),
            table_starts.data_ptr(),
            lens.data_ptr(),
            b,
            rows.start,
            rows.step,
            sliding_window or 0,
            float(softcap or 0.0),
            threads,
            out.data_ptr(),
        )
        raise_for_status("paged decode", status)

    @staticmethod
    def check_indices(
        tables: torch.Tensor,
        table_starts: torch.Tensor,
        lens: torch.Tensor,
        num_blocks: int,
        block_size: int,
    ) -> None:
        """ValueError unless each row's blocks are in its table and each block id is in the
        cache: the kernel follows every index it is given, and a bad one must raise rather
        than read memory it does not own."""
        if not len(lens):
            return
        if int(lens.min()) < 1:
            raise ValueError("paged decode: context lengths must be >= 1")
        if int(table_starts.min()) < 0:
            raise ValueError("paged decode: table starts must be >= 0")
        widths = (lens + block_size - 1) // block_size
        if int((table_starts + widths).max()) > len(tables):
            raise ValueError("paged decode: a row's context needs more blocks than its table")
        if len(tables):
            low, high = torch.aminmax(tables)
            if int(low) < 0 or int(high) >= num_blocks:
                raise ValueError(f"paged decode: block ids must be in [0, {num_blocks})")

    @staticmethod
    def check_index_lists(
        tables: list[int],
        table_starts: list[int],
        lens: list[int],
        num_blocks: int,
        block_size: int,
    ) -> None:
        """`check_indices` on the Python lists the tensors are made from: the same checks
        and errors, without the handful of tiny tensor ops (a runner's step at batch 1 pays
        more for those than for the lists' few elements)."""
        if not lens:
            return
        if min(lens) < 1:
            raise ValueError("paged decode: context lengths must be >= 1")
        if min(table_starts) < 0:
            raise ValueError("paged decode: table starts must be >= 0")
        if len(table_starts) != len(lens):
            raise ValueError("paged decode: one table start and length per row")
        widths = ((n + block_size - 1) // block_size for n in lens)
        if max(s + w for s, w in zip(table_starts, widths, strict=False)) > len(tables):
            raise ValueError("paged decode: a row's context needs more blocks than its table")
        if tables and (min(tables) < 0 or max(tables) >= num_blocks):
            raise ValueError(f"paged decode: block ids must be in [0, {num_blocks})")


def raise_for_status(kernel: str, status: int) -> None:
    """Nothing for status 0; else the exception a kernel's status stands for: MemoryError
    for its scratch, ValueError naming the argument out of range (nothing was run)."""
    if status == 0:
        return
    message = f"{kernel}: the native kernel refused the call: {native_build.status_message(status)}"
    if status == native_build.NO_MEMORY:
        raise MemoryError(message)
    raise ValueError(message)


def switched_off(kernel: str) -> None:
    """Record that `kernel` is off by the settings (the torch path by choice)."""
    native_build.record(
        native_build.KernelReport(kernel, "off", reason="engine.cpu_kernels is false")
    )


@functools.cache
def paged_decode(settings: KernelSettings = KernelSettings()) -> PagedDecodeKernel | None:
    """The kernel (the install's build, or compiled on first use); None where no library
    loads (a WARNING, once per settings: the slow path) or `settings` switch it off."""
    if not settings.enabled:
        log.info("native CPU kernels off (engine.cpu_kernels); decode attention runs in torch")
        switched_off(SOURCE.stem)
        return None
    try:
        return load_paged_decode(openmp=torch_uses_gnu_openmp(), settings=settings)
    except (RuntimeError, ValueError) as e:
        log.warning("slow path: decode attention runs in torch, no native kernel loads: %s", e)
        return None


def load_paged_decode(
    *,
    openmp: bool,
    settings: KernelSettings = KernelSettings(),
) -> PagedDecodeKernel:
    """Build (or take from the cache) and load the kernel; `openmp` tries the threaded build
    first, with GCC only (its `-fopenmp` links the `libgomp.so.1` torch has loaded).
    RuntimeError saying why when no build loads."""
    return load_native(SOURCE, PagedDecodeKernel, openmp=openmp, settings=settings)


def load_native(
    source: Path,
    wrap: Callable[[ctypes.CDLL, Path], K],
    *,
    openmp: bool,
    settings: KernelSettings = KernelSettings(),
) -> K:
    """`wrap` of `source`'s library: the one the install built for this CPU and these sources
    (the OpenMP build first where `openmp`), else one compiled now into the kernel cache (a
    source checkout without a build, or sources edited since). RuntimeError saying why
    when none loads. The outcome is recorded in `native_build.kernel_reports()`."""
    kernel = source.stem
    errors = []
    built = native_build.find_built(kernel, openmp=openmp) if source.parent == CSRC else []
    for path in built:
        try:
            loaded = _load(path, wrap)
        except (OSError, RuntimeError, AttributeError) as e:
            errors.append(f"[{path.name}] {e}")
            continue
        native_build.record(native_build.KernelReport(kernel, "built", str(path)))
        return loaded
    if not built:
        errors.append(f"no library built for this CPU and source in {native_build.BUILT_DIR}")
    try:
        loaded, path = _compile_and_load(source, wrap, openmp=openmp, settings=settings)
    except RuntimeError as e:
        reason = "; ".join([*errors, str(e)])
        native_build.record(native_build.KernelReport(kernel, "unavailable", reason=reason))
        raise RuntimeError(f"native kernel {source.name} unavailable: {reason}") from None
    native_build.record(native_build.KernelReport(kernel, "compiled", str(path)))
    return loaded


def _load(path: Path, wrap: Callable[[ctypes.CDLL, Path], K]) -> K:
    """`wrap` of the library at `path`; RuntimeError where loading it maps a second OpenMP
    runtime beside torch's (never run on that)."""
    runtimes = _openmp_runtimes()
    kernel = wrap(ctypes.CDLL(str(path)), path)
    added = _openmp_runtimes() - runtimes
    if added:
        raise RuntimeError(f"loading it mapped another OpenMP runtime {sorted(added)}")
    return kernel


def _compile_and_load(
    source: Path,
    wrap: Callable[[ctypes.CDLL, Path], K],
    *,
    openmp: bool,
    settings: KernelSettings,
) -> tuple[K, Path]:
    """`source` compiled for this CPU with `settings.compiler` (or taken from the kernel
    cache) and loaded: the OpenMP build first where `openmp` and the compiler is GCC, else
    the serial one. RuntimeError saying why when no build loads."""
    compiler = shlex.split(settings.compiler)  # "ccache gcc" works too
    if not compiler or shutil.which(compiler[0]) is None:
        raise RuntimeError(f"no C compiler {settings.compiler!r} on PATH (set engine.cc to one)")
    identity = native_build.compiler_identity(compiler)
    use_openmp = openmp and "Free Software Foundation" in identity
    flag_sets = (_OPENMP_FLAG_SETS if use_openmp else ()) + _SERIAL_FLAG_SETS
    errors = []
    for flags in flag_sets:
        try:
            path = _build(source, compiler, identity, flags, settings.resolved_cache_dir())
            return _load(path, wrap), path
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
            errors.append(f"[{' '.join(flags)}] {e}")
    raise RuntimeError("; ".join(errors))


def _build(
    source: Path, compiler: list[str], identity: str, flags: list[str], cache_dir: Path
) -> Path:
    """The shared library of `source` built with `flags`, from the cache when it is there."""
    command = " ".join([*compiler, *flags])
    key = hashlib.sha256(
        b"\0".join(
            [
                native_build.source_key(source).encode(),
                command.encode(),
                identity.encode(),
                _cpu_identity(),
            ]
        )
    ).hexdigest()[:16]
    target = cache_dir / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    # A build that failed once fails again with the same source, compiler and flags: the
    # reason is kept beside where the library would be, so later processes skip the compile.
    failed = target.with_suffix(".failed")
    if failed.exists():
        raise RuntimeError(f"{failed.read_text().strip()} (cached in {failed})")
    try:
        native_build.compile_library(compiler, flags, source, target)
    except RuntimeError as e:
        failed.write_text(f"{e}\n")
        raise
    log.info("built %s with %s", target, command)
    return target


def torch_uses_gnu_openmp() -> bool:
    """Whether this process has GNU OpenMP loaded as `libgomp.so.1`, as torch's Linux wheels
    do: a library linked against that soname then shares it."""
    return any(Path(p).name == "libgomp.so.1" for p in _openmp_runtimes())


def _openmp_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process (GNU, LLVM, Intel)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    fields = (line.split(maxsplit=5) for line in maps.splitlines())
    paths = {f[5] for f in fields if len(f) == 6}
    return {p for p in paths if Path(p).name.startswith(("libgomp", "libomp", "libiomp"))}


def _cpu_identity() -> bytes:
    """What -march=native depends on: the CPU's model and instruction-set flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor().encode() + platform.machine().encode()
    wanted = [
        line
        for line in info.splitlines()
        if line.startswith(("model name", "flags", "Features", "CPU part"))
    ]
    return "\n".join(dict.fromkeys(wanted)).encode()
