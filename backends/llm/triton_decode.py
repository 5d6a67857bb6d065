"""Decode attention over the paged KV cache in Triton (CUDA); safe in a CUDA graph.

Contract: `paged_decode(query, kv_cache, tables, lens, out, scaling, sliding_window, softcap)`
computes, for each of the first `B = tables.shape[0]` packed tokens (one decode each), the
attention of its query heads over its own context: the keys and values at positions
`[max(0, len - window), len)` of its sequence, found through its row of `tables` (block ids)
in the cache `(2, num_blocks, block_size, kv_heads, head_dim)`. It writes `out[:B]` and
nothing else. It is exact attention (what `attention._decode_batched` computes with a padded
gather and a mask, the reference it is tested against), accumulated in float32.

How: a program handles one KV head's group of query heads for one row and one split of
`SPLIT` context tokens (flash-decoding): it walks its split a tile of tokens at a time,
looking each token's block up in the table, so a row reads its own blocks up to its own
length and never pads to the longest context, and keeps an online softmax (running maximum
and sum, float32); a second kernel merges a row's splits. Splitting the context keeps a GPU
busy when a batch has few rows and long contexts: one program per (row, KV head) walking the
whole context gave an H200's 132 SMs about two programs each at 64 rows of a model with 4 KV
heads, each walking hundreds of tokens in series. The splits cover the width of the block tables,
fixed for a captured graph; a split past a row's length does nothing. Where the split
kernels fail their check on a device, the one-pass kernel (one program per row and KV head
over the whole context) runs instead. Block ids and lengths are read from device tensors,
so a launch records no host value: captured once in a graph, it stays right for whatever the
buffers hold at replay.

Triton ships with torch's CUDA builds; it is imported on first use, and `kernel_for(device)`
is None where it is missing or the device is not CUDA (callers then take the torch path).
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

# Tokens a program handles per iteration of its loop over the context.
TILE = 16
# The split kernel: context tokens per program (a long context is spread over many programs,
# so a batch of a few rows still fills the GPU), and per iteration of its loop.
SPLIT = 128
SPLIT_TILE = 16
# Splits a row may have (contexts up to 16k tokens); longer ones take the one-pass kernel.
MAX_SPLITS = 128
# Per device: whether the split kernel passed its check there (else the one-pass kernel).
_SPLIT_ON: dict[str, bool] = {}


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
    """A small decode (three rows, one of them over several splits) through each kernel and
    through torch, the split kernel first: a Triton that cannot compile one for this device
    (or computes something else) falls back to the other, or to the torch path, and says so
    once."""
    for split in (True, False):
        _SPLIT_ON[device] = split
        ok, reason = _check(device)
        if ok:
            return True
        kind = "split-context" if split else "one-pass"
        log.warning("Triton %s decode kernel not used on %s: %s", kind, device, reason)
    return False


def _check(device: str) -> tuple[bool, str]:
    from backends.llm.attention import PagedAttentionMetadata, _decode_batched

    try:
        gen = torch.Generator().manual_seed(0)
        blocks, block_size = 48, 16
        kv = torch.randn(2, blocks, block_size, 2, 16, generator=gen).to(device)
        query = torch.randn(1, 4, 3, 16, generator=gen).to(device)
        tables = torch.stack([torch.randperm(blocks, generator=gen)[:40] for _ in range(3)])
        tables = tables.to(device)
        lens = torch.tensor([7, 3, 40 * block_size - 5], device=device)
        expected = torch.zeros(3, 4, 16, device=device)
        meta = PagedAttentionMetadata([kv], torch.zeros(0), decode_batch=(tables, lens))
        _decode_batched(meta, query, kv.view(2, blocks, -1), expected, 0.25, None, None)
        out = torch.zeros_like(expected)
        paged_decode(query, kv, tables, lens, out, 0.25, None, None)
        if torch.allclose(out, expected, atol=1e-4, rtol=1e-4):
            return True, ""
        return False, "it disagrees with the torch path"
    except Exception as e:
        return False, f"{type(e).__name__}: {e}"


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
    kernels = _build()
    if kernels is None:
        raise RuntimeError("paged_decode needs Triton, which is not installed")
    if query.stride(3) != 1:
        query = query.contiguous()
    if _SPLIT_ON.get(str(query.device), False):
        _split_decode(kernels, query, kv_cache, tables, lens, out, scaling, sliding_window, softcap)
    else:
        _one_pass_decode(
            kernels, query, kv_cache, tables, lens, out, scaling, sliding_window, softcap
        )


def _one_pass_decode(
    kernels: Any,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    out: torch.Tensor,
    scaling: float,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """One program per (row, KV head) walks the row's whole context."""
    b = tables.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[3]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    keys, values = kv_cache[0], kv_cache[1]
    kernels.one_pass[(b, num_kv_heads)](
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


def _split_decode(
    kernels: Any,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    out: torch.Tensor,
    scaling: float,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """One program per (row, KV head, split of SPLIT context tokens) keeps a partial softmax
    (its maximum, sum and weighted values, float32); a second kernel merges a row's splits.
    The splits cover the width of `tables` (fixed for a captured graph); a split past a row's
    length does no work."""
    b, width = tables.shape
    num_heads, head_dim = query.shape[1], query.shape[3]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    group_p, head_dim_p = max(2, next_pow2(group)), max(16, next_pow2(head_dim))
    splits = max(1, -(-width * block_size // SPLIT))
    if splits > MAX_SPLITS:  # a context past MAX_SPLITS * SPLIT tokens: one pass per row
        _one_pass_decode(kernels, query, kv_cache, tables, lens, out, scaling, sliding_window,
                         softcap)  # fmt: skip
        return
    device = query.device
    maxima = torch.empty(b, num_kv_heads, splits, group_p, device=device, dtype=torch.float32)
    sums = torch.empty_like(maxima)
    partial = torch.empty(
        b, num_kv_heads, splits, group_p, head_dim_p, device=device, dtype=torch.float32
    )
    keys, values = kv_cache[0], kv_cache[1]
    kernels.split[(b, num_kv_heads, splits)](
        query, keys, values, tables, lens, maxima, sums, partial,
        float(scaling), float(softcap or 0.0), int(sliding_window or 0),
        query.stride(2), query.stride(1), tables.stride(0),
        keys.stride(0), keys.stride(1), keys.stride(2),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p, TILE=SPLIT_TILE, SPLIT=SPLIT,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None, num_warps=4,
    )  # fmt: skip
    kernels.merge[(b, num_kv_heads)](
        maxima, sums, partial, out, out.stride(0), out.stride(1), splits,
        GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        MAX_SPLITS=MAX_SPLITS, RUNTIME_BOUND=device.type == "cuda", num_warps=4,
    )  # fmt: skip


def next_pow2(n: int) -> int:
    """The smallest power of two at least `n` (Triton block shapes are powers of two)."""
    return 1 << (n - 1).bit_length()


@functools.cache
def _build() -> Any:
    """The jitted kernels (`triton_decode_kernels`), or None without Triton."""
    from backends.llm import triton_decode_kernels as kernels

    if not kernels.AVAILABLE:
        return None
    return types.SimpleNamespace(
        one_pass=kernels.paged_decode_kernel,
        split=kernels.paged_decode_split_kernel,
        merge=kernels.paged_decode_merge_kernel,
    )
