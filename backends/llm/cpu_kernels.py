"""Native CPU kernels, compiled on first use with the machine's C compiler, called via ctypes.

Decode attention on a CPU is bound by memory traffic: the whole context of every sequence is
read once per layer and step. Gathering a sequence's blocks into one tensor first (what plain
torch can do) copies that context and reads it twice more; `csrc/paged_decode.c` reads the
keys and values in place from the cache blocks instead. It is plain C (no torch headers), so
it builds in well under a second; the shared library is cached in `KernelSettings.cache_dir`
(default `~/.cache/model-hub/kernels`), keyed by the source, the flags and the CPU, and reused
by every later process.

Where no compiler is found, or the kernels are switched off (`KernelSettings.enabled`),
`paged_decode(settings)` returns None and the engine keeps its torch path; the reason is
logged once. `KernelSettings.compiler` picks the compiler (`cc` by default; arguments
allowed). The hub fills these from its settings (`engine:`); this module reads no environment
variable. A failed build is remembered in the cache (a `.failed`
file beside where the library would be) so later processes do not retry it; a different
compiler or source gets a fresh attempt.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from backends.llm.kernel_settings import KernelSettings

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
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
        fn.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64]
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
        per step, not once per layer)."""
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
        if status != 0:
            raise MemoryError("paged decode: no memory for its scratch buffers")

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


@functools.cache
def paged_decode(settings: KernelSettings = KernelSettings()) -> PagedDecodeKernel | None:
    """The compiled kernel, built on first use; None (reason logged once per settings) where
    it cannot be or `settings` switch it off."""
    if not settings.enabled:
        log.info("native CPU kernels off (engine.cpu_kernels); decode attention runs in torch")
        return None
    try:
        return load_paged_decode(openmp=torch_uses_gnu_openmp(), settings=settings)
    except (RuntimeError, ValueError) as e:
        log.warning("decode attention runs in torch (slower): %s", e)
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
    """`wrap` of the library built from `source` (or taken from the cache): the OpenMP build
    first where `openmp` and the compiler is GCC, else the serial one. RuntimeError saying
    why when no build loads."""
    compiler = shlex.split(settings.compiler)  # "ccache gcc" works too
    if not compiler or shutil.which(compiler[0]) is None:
        raise RuntimeError(f"no C compiler {settings.compiler!r} on PATH (set engine.cc to one)")
    identity = _compiler_identity(compiler)
    use_openmp = openmp and "Free Software Foundation" in identity
    flag_sets = (_OPENMP_FLAG_SETS if use_openmp else ()) + _SERIAL_FLAG_SETS
    errors = []
    for flags in flag_sets:
        try:
            path = _build(source, compiler, identity, flags, settings.resolved_cache_dir())
            runtimes = _openmp_runtimes()
            kernel = wrap(ctypes.CDLL(str(path)), path)
            added = _openmp_runtimes() - runtimes
            if added:  # a second OpenMP runtime next to torch's: never run on it
                raise RuntimeError(f"loading it mapped another OpenMP runtime {sorted(added)}")
            return kernel
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
            errors.append(f"[{' '.join(flags)}] {e}")
    raise RuntimeError(f"native kernel {source.name} unavailable: " + "; ".join(errors))


def _build(
    source: Path, compiler: list[str], identity: str, flags: list[str], cache_dir: Path
) -> Path:
    """The shared library of `source` built with `flags`, from the cache when it is there."""
    # The source and the headers beside it (what its quoted includes can name).
    code = b"\0".join(p.read_bytes() for p in [source, *sorted(source.parent.glob("*.h"))])
    command = " ".join([*compiler, *flags])
    key = hashlib.sha256(
        b"\0".join([code, command.encode(), identity.encode(), _cpu_identity()])
    ).hexdigest()[:16]
    target = cache_dir / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    # A build that failed once fails again with the same source, compiler and flags: the
    # reason is kept beside where the library would be, so later processes skip the compile.
    failed = target.with_suffix(".failed")
    if failed.exists():
        raise RuntimeError(f"{failed.read_text().strip()} (cached in {failed})")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes building at once never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [*compiler, *flags, "-o", tmp, str(source), "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["failed"])[-1]
            reason = f"{command} could not build {source.name}: {last}"
            failed.write_text(reason + "\n")
            raise RuntimeError(reason)
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep other users of the cache out
        os.replace(tmp, target)
        log.info("built %s with %s", target, command)
        return target
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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


def _compiler_identity(compiler: list[str]) -> str:
    """The compiler's `--version` text (part of the cache key; GCC's names its foundation)."""
    try:
        result = subprocess.run(
            [*compiler, "--version"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"cannot run the C compiler {' '.join(compiler)!r}: {e}") from e
    return result.stdout


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
