"""Decode attention over the paged KV cache as one Triton kernel (CUDA); safe in a CUDA graph.

Contract: `paged_decode(query, kv_cache, tables, lens, out, scaling, sliding_window, softcap)`
computes, for each of the first `B = tables.shape[0]` packed tokens (one decode each), the
attention of its query heads over its own context: the keys and values at positions
`[max(0, len - window), len)` of its sequence, found through its row of `tables` (block ids)
in the cache `(2, num_blocks, block_size, kv_heads, head_dim)`. It writes `out[:B]` and
nothing else. It is exact attention (what `attention._decode_batched` computes with a padded
gather and a mask, the reference it is tested against), accumulated in float32.

How: one program per (row, KV head) handles that head's group of query heads. It walks the
row's context a tile of tokens at a time, looking each token's block up in the table, so a
row reads its own blocks up to its own length and never pads to the longest context; the
softmax is online (running maximum and sum). Block ids and lengths are read from device
tensors, so a launch records no host value: captured once in a graph, it stays right for
whatever the buffers hold at replay.

Triton ships with torch's CUDA builds; it is imported on first use, and `kernel_for(device)`
is None where it is missing or the device is not CUDA (callers then take the torch path).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

# Tokens a program handles per iteration of its loop over the context.
TILE = 16


def available() -> bool:
    """Whether Triton can be imported here."""
    return _build() is not None


def kernel_for(device: torch.device) -> Callable[..., None] | None:
    """`paged_decode` where it runs on `device` (CUDA with Triton, and a first small call
    there matched the torch path), else None."""
    if device.type != "cuda" or not available():
        return None
    return paged_decode if _works_on(str(device)) else None


@functools.cache
def _works_on(device: str) -> bool:
    """One small decode through the kernel and through torch: a Triton that cannot compile
    for this device (or computes something else) is not used, and says so once."""
    from backends.llm.attention import PagedAttentionMetadata, _decode_batched

    try:
        gen = torch.Generator().manual_seed(0)
        kv = torch.randn(2, 4, 4, 2, 16, generator=gen).to(device)
        query = torch.randn(1, 4, 2, 16, generator=gen).to(device)
        tables = torch.tensor([[2, 0], [1, 3]], device=device)
        lens = torch.tensor([7, 3], device=device)
        expected = torch.zeros(2, 4, 16, device=device)
        meta = PagedAttentionMetadata([kv], torch.zeros(0), decode_batch=(tables, lens))
        _decode_batched(meta, query, kv.view(2, 4, -1), expected, 0.25, None, None)
        out = torch.zeros_like(expected)
        paged_decode(query, kv, tables, lens, out, 0.25, None, None)
        ok = torch.allclose(out, expected, atol=1e-4, rtol=1e-4)
        reason = "it disagrees with the torch path"
    except Exception as e:
        ok, reason = False, f"{type(e).__name__}: {e}"
    if not ok:
        log.warning("Triton decode kernel not used on %s: %s", device, reason)
    return ok


def paged_decode(
    query: torch.Tensor,  # (1, H, T, D)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, KV, D), contiguous
    tables: torch.Tensor,  # (B, W) int64: each decode's block ids, padded with any valid id
    lens: torch.Tensor,  # (B,) int64: context lengths, own token included, each >= 1
    out: torch.Tensor,  # (T, H, D): rows [:B] are written
    scaling: float,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """Decode attention of the first B packed tokens over their paged contexts (see the
    module docstring)."""
    kernel = _build()
    if kernel is None:
        raise RuntimeError("paged_decode needs Triton, which is not installed")
    b = tables.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[3]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    if query.stride(3) != 1:
        query = query.contiguous()
    keys, values = kv_cache[0], kv_cache[1]
    kernel[(b, num_kv_heads)](
        query,
        keys,
        values,
        tables,
        lens,
        out,
        float(scaling),
        float(softcap or 0.0),
        int(sliding_window or 0),
        query.stride(2),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        tables.stride(0),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_P=max(2, next_pow2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_P=max(16, next_pow2(head_dim)),
        TILE=TILE,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        num_warps=4,
    )


def next_pow2(n: int) -> int:
    """The smallest power of two at least `n` (Triton block shapes are powers of two)."""
    return 1 << (n - 1).bit_length()


@functools.cache
def _build() -> Any:
    """The jitted kernel, or None without Triton (defined here: its decorator needs it)."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # not installed, or an install that cannot load here
        return None

    # Block tables and lengths change with every eager step (their width, their offset in
    # the step's packed tensor): specializing on them would compile a variant mid-serving.
    @triton.jit(do_not_specialize=["tables_ptr", "lens_ptr", "stride_table"])  # type: ignore[misc,unused-ignore]
    def _paged_decode_kernel(  # type: ignore[no-untyped-def]
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        lens_ptr,
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
        GROUP_P: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_P: tl.constexpr,
        TILE: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        length = tl.load(lens_ptr + row).to(tl.int32)
        start = length * 0
        if HAS_WINDOW:
            start = tl.maximum(length - window, 0)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, HEAD_DIM_P)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        heads = kv_head * GROUP + g
        q_mask = g_ok[:, None] & d_ok[None, :]
        q_offsets = row * stride_q_token + heads[:, None] * stride_q_head + d[None, :]
        # Float arguments may arrive as float64 (Inductor passes Python floats so): the
        # products are cast back so that the loop's carried values stay float32.
        q = (tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32) * scale).to(
            tl.float32
        )
        m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
        t = tl.arange(0, TILE)
        for tile_start in range(start, length, TILE):
            pos = tile_start + t
            ok = pos < length
            block = tl.load(tables_ptr + row * stride_table + pos // BLOCK_SIZE, mask=ok, other=0)
            base = (
                block.to(tl.int64) * stride_k_block
                + (pos % BLOCK_SIZE) * stride_k_slot
                + kv_head * stride_k_head
            )
            kv_mask = ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # (G, TILE)
            if HAS_SOFTCAP:
                s = (softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)).to(tl.float32)  # tanh
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)  # (G, D)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        o = acc / l_i[:, None]
        o_offsets = row * stride_o_token + heads[:, None] * stride_o_head + d[None, :]
        tl.store(out_ptr + o_offsets, o.to(out_ptr.dtype.element_ty), mask=q_mask)

    return _paged_decode_kernel
