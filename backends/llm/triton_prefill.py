"""Prefill attention over the paged KV cache: every chunk of a step in one Triton kernel (CUDA).

Contract: `paged_prefill(query, kv_cache, batch, out, scaling, sliding_window, softcap)`
computes, for every packed token of the step's prefill chunks (`batch`, a `PrefillBatch`),
the causal attention of its query heads over its own sequence: the keys and values at
positions `[lo, p]`, where `p` is the token's position and `lo` is 0, or `p - window + 1`
with a sliding window, found through its chunk's row of `batch.tables` in the cache
`(2, num_blocks, block_size, kv_heads, head_dim)`. The step's new K/V must already be in the
cache (the runner's one scatter through the slot mapping), so a chunk sees the tokens cached
before it (a prefix-cache hit, earlier chunks of a chunked prefill) and itself alike. Query
head `h` reads K/V head `h // (heads // kv_heads)`; soft-capping caps the scaled logits. It
writes the chunks' rows of `out` and nothing else. `paged_prefill_reference` is the same
contract in torch (one SDPA call per chunk, the path the CPU takes), which the kernel is
tested against and which stands in where the kernel cannot run.

How: one program per (chunk, tile of its queries, KV head). The tile's rows are its tokens
times the KV head's group of query heads, so the group shares every K/V load. It walks the
keys from the earliest any of its queries sees to its last query's position, a tile of keys
at a time, looking each key's block up in the chunk's table; the softmax is online (running
maximum and sum in float32) and the products run on tensor cores in the cache's dtype
(float32 in full IEEE precision). All metadata are device tensors built once a step.

Triton ships with torch's CUDA builds; it is imported on first use, and `kernel_for(device)`
is None where it is missing, the device is not CUDA, or a first small call there disagreed
with the torch path (logged once; callers then take the torch path).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from backends.llm.triton_decode import next_pow2

log = logging.getLogger(__name__)

# Rows of a program's query tile (tokens x the KV head's query heads), and keys per
# iteration of its loop over the context.
BLOCK_M = 64
BLOCK_N = 64


@dataclass(frozen=True)
class PrefillBatch:
    """The step's prefill chunks as one varlen batch, built once a step by the runner."""

    # Chunk i's tokens are `[query_starts[i], query_starts[i + 1])` of the packed batch.
    query_starts: torch.Tensor  # (N + 1,) int32
    # Its first token's position: the tokens of its sequence cached before it.
    context_starts: torch.Tensor  # (N,) int32
    # Its block ids, enough for its last position, padded with block 0.
    tables: torch.Tensor  # (N, W) int32
    # The longest chunk, in tokens (how many query tiles a chunk may need).
    max_chunk_len: int

    @classmethod
    def build(
        cls,
        query_starts: Sequence[int],
        context_starts: Sequence[int],
        tables: Sequence[Sequence[int]],
        device: torch.device | str,
    ) -> PrefillBatch:
        """From host lists, in one host-to-device copy: `query_starts` has one entry more
        than there are chunks (the end of the last)."""
        n = len(context_starts)
        if len(query_starts) != n + 1 or len(tables) != n or n == 0:
            raise ValueError("a prefill batch needs N chunks: N + 1 query starts, N tables")
        width = max(len(row) for row in tables)
        flat = [*query_starts, *context_starts]
        for row in tables:
            flat.extend(row)
            flat.extend([0] * (width - len(row)))
        packed = torch.tensor(flat, dtype=torch.int32).to(device)
        longest = max(b - a for a, b in itertools.pairwise(query_starts))
        return cls(
            query_starts=packed[: n + 1],
            context_starts=packed[n + 1 : 2 * n + 1],
            tables=packed[2 * n + 1 :].view(n, width),
            max_chunk_len=longest,
        )


def available() -> bool:
    """Whether Triton can be imported here."""
    return _build() is not None


# (query heads, KV heads, head size, block size) of the self-check when the caller names none.
SMALL = (4, 2, 16, 4)


def kernel_for(
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    shape: tuple[int, int, int, int] = SMALL,
) -> Callable[..., None] | None:
    """`paged_prefill` where it runs on `device` for a cache of `dtype` and a model of
    `shape` (query heads, KV heads, head size, block size): CUDA with Triton, and a first
    small call there matched the torch path. Else None."""
    if device.type != "cuda" or not available():
        return None
    return paged_prefill if _works_on(str(device), dtype, shape) else None


@functools.cache
def _works_on(device: str, dtype: torch.dtype, shape: tuple[int, int, int, int]) -> bool:
    """A small step through the kernel and through torch (a fresh prompt, and a chunk after
    cached context) at the model's head shapes: a Triton that cannot compile that for this
    device (no room for its tiles, say), or computes something else, is not used, and says
    so once."""
    heads, kv_heads, head_dim, block_size = shape
    try:
        gen = torch.Generator().manual_seed(0)
        need = -(-5 // block_size), -(-9 // block_size)  # blocks of the two chunks
        ids = torch.randperm(sum(need), generator=gen).tolist()
        kv = torch.randn(2, len(ids), block_size, kv_heads, head_dim, generator=gen)
        query = torch.randn(1, heads, 8, head_dim, generator=gen).to(device, dtype)
        kv = kv.to(device, dtype)
        tables = [ids[: need[0]], ids[need[0] :]]
        batch = PrefillBatch.build([0, 5, 8], [0, 6], tables, device)
        expected = torch.zeros(8, heads, head_dim, device=device, dtype=dtype)
        scale = head_dim**-0.5
        paged_prefill_reference(query, kv, batch, expected, scale, None, None)
        out = torch.zeros_like(expected)
        paged_prefill(query, kv, batch, out, scale, None, None)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        ok = torch.allclose(out.float(), expected.float(), atol=tol, rtol=tol)
        reason = "it disagrees with the torch path"
    except Exception as e:
        ok, reason = False, f"{type(e).__name__}: {e}"
    if not ok:
        log.warning(
            "Triton prefill kernel not used on %s for %s, heads %s: %s",
            device,
            dtype,
            shape,
            reason,
        )
    return ok


def paged_prefill_reference(
    query: torch.Tensor,  # (1, H, T, D)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, KV, D)
    batch: PrefillBatch,
    out: torch.Tensor,  # (T, H, D): the chunks' rows are written
    scaling: float,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """`paged_prefill`'s contract in torch: each chunk attends with one SDPA call over the
    context read back from its blocks (`attention.prefill_chunks`)."""
    from backends.llm.attention import PagedAttentionMetadata, PrefillChunk, prefill_chunks

    starts = batch.query_starts.tolist()
    contexts = batch.context_starts.tolist()
    chunks = []
    for i, (t0, t1, start) in enumerate(zip(starts, starts[1:], contexts, strict=False)):
        width = -(-(start + t1 - t0) // kv_cache.shape[2])
        chunks.append(PrefillChunk(t0, t1, start, batch.tables[i, :width].long()))
    no_slots = torch.zeros(0, dtype=torch.long, device=kv_cache.device)
    meta = PagedAttentionMetadata([kv_cache], no_slots, prefills=chunks)
    prefill_chunks(meta, kv_cache, query, None, None, out, scaling, sliding_window, softcap)


def paged_prefill(
    query: torch.Tensor,  # (1, H, T, D)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, KV, D), contiguous
    batch: PrefillBatch,
    out: torch.Tensor,  # (T, H, D): the chunks' rows are written
    scaling: float,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """Prefill attention of every chunk of the step over its paged context (see the module
    docstring)."""
    kernel = _build()
    if kernel is None:
        raise RuntimeError("paged_prefill needs Triton, which is not installed")
    num_heads, head_dim = query.shape[1], query.shape[3]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    if query.stride(3) != 1:
        query = query.contiguous()
    block_m = max(BLOCK_M, next_pow2(group))
    block_q = block_m // group  # tokens per query tile
    head_dim_p = max(16, next_pow2(head_dim))
    block_n = BLOCK_N if head_dim_p <= 128 else BLOCK_N // 2
    keys, values = kv_cache[0], kv_cache[1]
    chunks = batch.tables.shape[0]
    grid = (chunks, -(-batch.max_chunk_len // block_q), num_kv_heads)
    kernel[grid](
        query,
        keys,
        values,
        batch.query_starts,
        batch.context_starts,
        batch.tables,
        out,
        float(scaling),
        float(softcap or 0.0),
        int(sliding_window or 0),
        query.stride(2),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        batch.tables.stride(0),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        BLOCK_SIZE=block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",
        # CPU tensors only run in Triton's interpreter, whose half-precision products are
        # wrong: there the products take float32 operands.
        DOT_F32=query.device.type == "cpu",
        num_warps=4,
        num_stages=2,
    )


@functools.cache
def _build() -> Any:
    """The jitted kernel, or None without Triton (defined here: its decorator needs it)."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # not installed, or an install that cannot load here
        return None

    # The chunks' metadata are views of one packed tensor whose layout changes every step
    # (offsets, table width): specializing on them would compile variants mid-serving
    # (0.7 s each on an H200).
    @triton.jit(do_not_specialize=["context_starts_ptr", "tables_ptr", "stride_table"])  # type: ignore[misc,unused-ignore]
    def _paged_prefill_kernel(  # type: ignore[no-untyped-def]
        q_ptr,
        k_ptr,
        v_ptr,
        query_starts_ptr,
        context_starts_ptr,
        tables_ptr,
        out_ptr,
        scale,
        softcap,
        window,
        stride_q_token,
        stride_q_head,
        stride_o_token,
        stride_o_head,
        stride_table,
        stride_k_block,
        stride_k_slot,
        stride_k_head,
        BLOCK_SIZE: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_P: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        PRECISION: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        chunk = tl.program_id(0)
        first = tl.program_id(1) * BLOCK_Q  # the tile's first token within its chunk
        kv_head = tl.program_id(2)
        q_start = tl.load(query_starts_ptr + chunk)
        chunk_len = tl.load(query_starts_ptr + chunk + 1) - q_start
        if first >= chunk_len:  # a shorter chunk than the longest: nothing to do
            return
        context = tl.load(context_starts_ptr + chunk)

        # Row r of the tile: token first + r // GROUP, query head kv_head * GROUP + r % GROUP.
        r = tl.arange(0, BLOCK_M)
        token = first + r // GROUP
        head = kv_head * GROUP + r % GROUP
        row_ok = (r < BLOCK_Q * GROUP) & (token < chunk_len)
        d = tl.arange(0, HEAD_DIM_P)
        d_ok = d < HEAD_DIM
        q_rows = (q_start + token).to(tl.int64)
        q_offsets = q_rows[:, None] * stride_q_token + head[:, None] * stride_q_head + d[None, :]
        q_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        q_pos = context + token  # (BLOCK_M,): each row's position in its sequence

        # Keys from the earliest any row sees up to the tile's last query position.
        last = tl.minimum(first + BLOCK_Q, chunk_len)
        end = context + last
        lo = end * 0
        if HAS_WINDOW:
            lo = tl.maximum(context + first - window + 1, 0)
            lo = (lo // BLOCK_N) * BLOCK_N

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
        n = tl.arange(0, BLOCK_N)
        log2e = 1.4426950408889634
        for key_start in range(lo, end, BLOCK_N):
            k_pos = key_start + n
            k_ok = k_pos < end
            block = tl.load(
                tables_ptr + chunk * stride_table + k_pos // BLOCK_SIZE, mask=k_ok, other=0
            )
            base = (
                block.to(tl.int64) * stride_k_block
                + (k_pos % BLOCK_SIZE) * stride_k_slot
                + kv_head * stride_k_head
            )
            kt_mask = d_ok[:, None] & k_ok[None, :]
            kt = tl.load(k_ptr + base[None, :] + d[:, None], mask=kt_mask, other=0.0)
            if DOT_F32:
                kt = kt.to(tl.float32)
            s = tl.dot(q, kt, input_precision=PRECISION) * scale  # (BLOCK_M, BLOCK_N) fp32
            if HAS_SOFTCAP:
                s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh
            seen = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
            if HAS_WINDOW:
                seen = seen & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(seen, s * log2e, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row that has seen no key yet keeps a maximum of -inf: subtract 0 instead.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_mask = k_ok[:, None] & d_ok[None, :]
            v = tl.load(v_ptr + base[:, None] + d[None, :], mask=v_mask, other=0.0)
            if DOT_F32:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_offsets = q_rows[:, None] * stride_o_token + head[:, None] * stride_o_head + d[None, :]
        tl.store(out_ptr + o_offsets, o.to(out_ptr.dtype.element_ty), mask=q_mask)

    return _paged_prefill_kernel
