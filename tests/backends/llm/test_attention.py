"""The paged attention function against plain dense attention: decodes and prefill chunks
(with and without earlier context) in one packed step, grouped-query heads, sliding windows,
soft-capping, and every decode path (per sequence in torch; batched; the native CPU kernel,
threaded and serial, over head sizes that take its vector and scalar code)."""

from __future__ import annotations

import functools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from backends.llm import cpu_kernels, native_build
from backends.llm.attention import (
    NativeDecode,
    PagedAttentionMetadata,
    PrefillChunk,
    paged_attention,
)

NUM_BLOCKS = 128


@dataclass(frozen=True)
class Shape:
    kv: int = 2  # key/value heads
    heads: int = 4  # query heads
    dim: int = 8  # head size
    block: int = 4  # tokens per cache block


SMALL = Shape()


class Layer(torch.nn.Module):
    layer_idx = 0


def dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: range,
    window: int | None,
    softcap: float | None,
    scale: float,
) -> torch.Tensor:
    """Reference: queries at `positions` over keys 0..position, per head. q (n, H, D)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (L, H, D)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = []
    for i, p in enumerate(positions):
        lo = 0 if window is None else max(0, p - window + 1)
        scores = torch.einsum("hd,lhd->hl", q[i], k[lo : p + 1]) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v[lo : p + 1]))
    return torch.stack(out)


# Sequences: (tokens already cached, tokens computed this step). One token: a decode.
MIXED = [(37, 1), (4, 1), (8, 12), (0, 9), (0, 1)]


@functools.cache
def native_kernel(openmp: bool) -> cpu_kernels.PagedDecodeKernel:
    compiler = os.environ.get("CC") or "cc"
    try:
        kernel = cpu_kernels.load_paged_decode(openmp=openmp)
    except RuntimeError:
        pytest.skip(f"no built kernel and no C compiler {compiler!r} to build one")
    if openmp and not kernel.threaded:
        pytest.skip("this process has no GNU OpenMP runtime (torch's) to build against")
    return kernel


DECODE_PATHS = ["each", "batched", "native", "native-serial"]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("decode_path", DECODE_PATHS)
def test_packed_step_equals_dense_attention(
    window: int | None, softcap: float | None, decode_path: str
) -> None:
    check_step(MIXED, window, softcap, decode_path)


# Head sizes the native kernel takes different code for: vectors of 8 (64 in registers, or
# a remainder of the 64-wide tile) and plain scalar loops; blocks of 16 give it runs of 8
# keys; one query head per key head, and eight.
@pytest.mark.parametrize(
    "shape",
    [
        Shape(kv=2, heads=4, dim=64, block=16),
        Shape(kv=1, heads=8, dim=96, block=16),
        Shape(kv=3, heads=3, dim=12, block=8),
        Shape(kv=2, heads=4, dim=128, block=5),
    ],
    ids=str,
)
@pytest.mark.parametrize("decode_path", ["native", "native-serial", "each"])
def test_native_decode_over_head_sizes_and_blocks_equals_dense_attention(
    shape: Shape, decode_path: str
) -> None:
    plan = [(n, 1) for n in (0, 7, 8, 15, 16, 17, 40, 100)] + [(20, 9)]
    for window, softcap in ((None, None), (33, None), (None, 2.0)):
        check_step(plan, window, softcap, decode_path, shape)


@pytest.mark.parametrize("decode_path", ["native", "native-serial"])
def test_contexts_longer_than_a_chunk_equal_dense_attention(decode_path: str) -> None:
    """Past 512 tokens (csrc/attend.h `ATTEND_CHUNK`) the kernel takes a context in chunks,
    with a running maximum and sum per head, in scratch that does not grow with it."""
    shape = Shape(kv=2, heads=4, dim=64, block=64)
    plan = [(n, 1) for n in (511, 512, 513, 1100, 2100)]
    for window, softcap in ((None, None), (700, None), (None, 2.0)):
        check_step(plan, window, softcap, decode_path, shape)


@pytest.mark.parametrize("decode_path", ["each", "native", "native-serial"])
def test_many_decodes_shared_by_two_threads_equal_dense_attention(decode_path: str) -> None:
    plan = [(n, 1) for n in (3, 50, 17, 4, 33, 8, 21, 2, 40, 12, 5, 29)] + [(0, 7)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the per-sequence decodes split over two threads
    try:
        check_step(plan, 6, None, decode_path)
    finally:
        torch.set_num_threads(threads)


def test_the_native_kernel_refuses_tensors_it_cannot_read() -> None:
    kernel = native_kernel(False)
    q = torch.zeros(1, 2, 2, 8)
    cache = torch.zeros(2, 4, 4, 2, 8)
    ids = torch.zeros(1, dtype=torch.long)
    args = (cache, ids, ids, torch.ones(1, dtype=torch.long), torch.empty_like(q))
    with pytest.raises(ValueError, match="float32"):
        kernel(q.double(), *args, sliding_window=None, softcap=None)
    with pytest.raises(ValueError, match="shapes disagree"):
        kernel(torch.zeros(1, 2, 2, 4), *args, sliding_window=None, softcap=None)
    with pytest.raises(ValueError, match="int64"):
        kernel(q, cache, ids.int(), *args[2:], sliding_window=None, softcap=None)
    # Indices the kernel would follow out of its buffers: refused before the call.
    five = torch.tensor([5])
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 4\)"):
        kernel(q, cache, five, *args[2:], sliding_window=None, softcap=None)
    with pytest.raises(ValueError, match="more blocks than its table"):
        kernel(q, cache, ids, ids, five, args[4], sliding_window=None, softcap=None)
    with pytest.raises(ValueError, match="lengths must be >= 1"):
        kernel(q, cache, ids, ids, ids, args[4], sliding_window=None, softcap=None)
    # The runner's once-a-step check on the Python lists refuses the same indices.
    check = kernel.check_index_lists
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 4\)"):
        check([5], [0], [1], 4, 4)
    with pytest.raises(ValueError, match="more blocks than its table"):
        check([0], [0], [5], 4, 4)
    with pytest.raises(ValueError, match="lengths must be >= 1"):
        check([0], [0], [0], 4, 4)
    check([0, 3], [0], [5], 4, 4)  # two blocks of 4 hold 5 tokens


@pytest.mark.parametrize("openmp", [True, False])
def test_the_native_kernel_itself_refuses_indices_out_of_range(openmp: bool) -> None:
    """Past the Python checks (`indices_checked=True` skips them), the C entry point checks
    every index it follows and refuses the call, leaving the output untouched."""
    kernel = native_kernel(openmp)
    q = torch.ones(2, 2, 2, 8)
    cache = torch.ones(2, 4, 4, 2, 8)
    good = {
        "tables": torch.tensor([0, 1, 2]),
        "table_starts": torch.tensor([0, 2]),
        "lens": torch.tensor([8, 3]),
    }
    for change, message in [
        ({"tables": torch.tensor([0, 4, 2])}, "block id is outside the KV cache"),
        ({"tables": torch.tensor([0, -1, 2])}, "block id is outside the KV cache"),
        ({"table_starts": torch.tensor([0, 3])}, "outside its block table"),
        ({"table_starts": torch.tensor([-1, 2])}, "outside its block table"),
        ({"lens": torch.tensor([8, 5])}, "outside its block table"),  # row 1: 2 blocks
        ({"lens": torch.tensor([8, 0])}, "context length"),
    ]:
        out = torch.full_like(q, 7.0)
        args = good | change
        with pytest.raises(ValueError, match=f"refused the call: .*{message}"):
            kernel(q, cache, **args, out=out, sliding_window=None, softcap=None,
                   indices_checked=True)  # fmt: skip
        assert bool((out == 7.0).all()), "nothing is computed for a refused call"
    out = torch.zeros_like(q)
    kernel(q, cache, **good, out=out, sliding_window=None, softcap=None, indices_checked=True)
    assert torch.allclose(out, torch.ones_like(q))  # equal values: any weights average to 1


def test_a_failed_build_is_remembered_and_not_retried(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler 'cc'")
    # No library built at install: the kernel is compiled on first use (a source checkout).
    monkeypatch.setattr(native_build, "BUILT_DIR", tmp_path / "not-built")
    # A flag the compiler rejects stands in for a compiler too old for the source.
    settings = cpu_kernels.KernelSettings(
        cache_dir=tmp_path, compiler="cc -fno-such-flag-for-this-test"
    )
    with pytest.raises(RuntimeError, match="could not build") as first:
        cpu_kernels.load_paged_decode(openmp=False, settings=settings)
    assert "cached in" not in str(first.value)
    remembered = sorted(p.name for p in tmp_path.glob("*.failed"))
    assert remembered, "the failures are written to the cache"
    with pytest.raises(RuntimeError, match=r"could not build.*cached in"):
        cpu_kernels.load_paged_decode(openmp=False, settings=settings)
    assert sorted(p.name for p in tmp_path.glob("*.failed")) == remembered
    assert not list(tmp_path.glob("*.so"))


def test_without_a_built_library_or_compiler_or_switched_off_the_torch_path_is_said(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native_build, "BUILT_DIR", tmp_path / "not-built")
    missing = cpu_kernels.KernelSettings(cache_dir=tmp_path, compiler="no-such-compiler-here")
    assert cpu_kernels.paged_decode(missing) is None
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert any("slow path" in r.getMessage() for r in warnings)
    assert "no-such-compiler-here" in caplog.text
    report = {r.kernel: r for r in native_build.kernel_reports()}["paged_decode"]
    assert (report.state, report.slow_path) == ("unavailable", True)
    assert report.reason is not None and "no library built" in report.reason
    off = cpu_kernels.KernelSettings(enabled=False, cache_dir=tmp_path)
    assert cpu_kernels.paged_decode(off) is None
    assert not list(tmp_path.iterdir()), "switched off, nothing is built"
    assert {r.kernel: r.state for r in native_build.kernel_reports()}["paged_decode"] == "off"


def check_step(
    plan: list[tuple[int, int]],
    window: int | None,
    softcap: float | None,
    decode_path: str,
    shape: Shape = SMALL,
) -> None:
    """Run one packed step of `plan` through paged attention; compare with dense."""
    KV, H, D, BS = shape.kv, shape.heads, shape.dim, shape.block
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.zeros(2, NUM_BLOCKS, BS, KV, D)
    free = iter(torch.randperm(NUM_BLOCKS, generator=gen).tolist())  # scattered blocks
    seqs = []
    for cached, new in plan:
        total = cached + new
        k = torch.randn(total, KV, D, generator=gen)
        v = torch.randn(total, KV, D, generator=gen)
        q = torch.randn(total, H, D, generator=gen)
        table = [next(free) for _ in range(-(-total // BS))]
        slots = [table[p // BS] * BS + p % BS for p in range(total)]
        for p in range(cached):  # earlier steps wrote these
            kv_cache[0].view(-1, KV, D)[slots[p]] = k[p]
            kv_cache[1].view(-1, KV, D)[slots[p]] = v[p]
        seqs.append((cached, new, k, v, q, table, slots))

    decodes = [s for s in seqs if s[1] == 1]
    chunks = [s for s in seqs if s[1] > 1]
    order = decodes + chunks  # the runner packs decodes first
    query = torch.cat([q[c : c + n] for c, n, _, _, q, _, _ in order])  # (T, H, D)
    key = torch.cat([k[c : c + n] for c, n, k, _, _, _, _ in order])
    value = torch.cat([v[c : c + n] for c, n, _, v, _, _, _ in order])
    slot_mapping = torch.tensor([p for c, n, *_, slots in order for p in slots[c : c + n]])
    prefills, t = [], len(decodes)
    for c, n, *_, table, _ in chunks:
        prefills.append(PrefillChunk(t, t + n, c, torch.tensor(table)))
        t += n
    tables = [torch.tensor(table) for *_, table, _ in decodes]
    lens = [c + 1 for c, *_ in decodes]
    batch = native = None
    if decode_path == "batched":
        width = max(len(tb) for tb in tables)
        padded = torch.stack([torch.cat([tb, tb.new_zeros(width - len(tb))]) for tb in tables])
        batch = (padded, torch.tensor(lens))
    elif decode_path.startswith("native"):
        starts = torch.tensor([0] + [len(tb) for tb in tables[:-1]]).cumsum(0)
        native = NativeDecode(
            native_kernel(openmp=decode_path == "native"),
            torch.cat(tables),
            starts,
            torch.tensor(lens),
        )
    meta = PagedAttentionMetadata(
        kv_caches=[kv_cache],
        slot_mapping=slot_mapping,
        decode_tables=tables,
        decode_lens=lens,
        decode_batch=batch,
        native_decode=native,
        prefills=prefills,
    )
    scale = 0.3
    out, _ = paged_attention(
        Layer(),
        query.transpose(0, 1)[None],  # (1, H, T, D) as transformers passes it
        key.transpose(0, 1)[None],
        value.transpose(0, 1)[None],
        None,
        scaling=scale,
        sliding_window=window,
        softcap=softcap,
        paged_metadata=meta,
    )
    expected = torch.cat(
        [
            dense(q[c : c + n], k, v, range(c, c + n), window, softcap, scale)
            for c, n, k, v, q, _, _ in order
        ]
    )
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)


def test_the_attention_function_refuses_to_run_without_step_metadata() -> None:
    x = torch.zeros(1, SMALL.heads, 1, SMALL.dim)
    with pytest.raises(RuntimeError, match="paged_metadata"):
        paged_attention(Layer(), x, x[:, : SMALL.kv], x[:, : SMALL.kv], None)
