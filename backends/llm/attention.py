"""Paged attention as a transformers attention function, so any supported decoder runs as is.

`register()` adds `paged_attention` to transformers' `AttentionInterface` under
`ATTENTION_NAME`; a model loaded with `attn_implementation=ATTENTION_NAME` then calls it from
every attention layer with that layer's query, key and value for the step's packed batch
(all scheduled tokens of all sequences as one `(1, T)` row), its `scaling`, `sliding_window`
and `softcap`. transformers builds no mask for an unknown implementation; the per-step
`PagedAttentionMetadata` arrives as the `paged_metadata` keyword of the model's forward.

Per layer: the step's new K/V are written into the paged cache through the slot mapping (all
of them, before any read, so sequences scheduled together may share freshly filled prefix
blocks). Then each single-token sequence (a decode) attends over exactly its own context.

- On a CPU in float32: one call per layer to a native kernel (`backends.llm.cpu_kernels`)
  that reads each context in place from its blocks, on torch's OpenMP threads; gathering a
  copy first moves about three times the memory.
- On a CPU without the kernel (no compiler, other dtypes): each decode's blocks are gathered
  (keys and values in one call) and its query heads, viewed as `(kv_heads, group, D)`, meet
  their shared K/V head in two small matmuls. Measured on CPU, this beats one padded, masked
  batch per step by about 2x. Those calls are too small for torch's intra-op threads, so
  they run on one thread each, and with more than one core two Python threads share them.
- On an accelerator, where one big kernel beats many small ones: one padded, masked SDPA
  call for all decodes (which then picks its fused kernels), or, on CUDA with Triton, one
  kernel that reads each decode's own blocks up to its length (`backends.llm.triton_decode`).
  The same call, over static buffers, is what a captured decode step replays
  (`backends.llm.decode_graphs`).

A sliding window is a slice of the context, not a mask. The longer chunks (prompts, chunked
prefills, recomputations): on CUDA with Triton, all of a step's chunks in one varlen causal
kernel that reads each chunk's context from its blocks (`backends.llm.triton_prefill`);
elsewhere each attends with SDPA over its own context (`enable_gqa`, a causal kernel when it
has no earlier context). Soft-capped layers (Gemma 2) cap the logits on the explicit path,
since SDPA cannot.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from backends.llm.cpu_kernels import PagedDecodeKernel
from backends.threads import set_this_thread, single_threaded

if TYPE_CHECKING:
    from backends.llm.triton_prefill import PrefillBatch

ATTENTION_NAME = "hub_paged"


@dataclass
class PrefillChunk:
    """A sequence with more than one token in the step."""

    # Its tokens are `[token_start, token_end)` of the packed batch ...
    token_start: int
    token_end: int
    # ... at positions `[context_start, context_start + token_end - token_start)`.
    context_start: int
    # Its blocks, enough for the chunk's last position.
    block_table: torch.Tensor  # (num_blocks,) long


@dataclass(frozen=True)
class NativeDecode:
    """The decodes' tables and lengths as the native kernel reads them."""

    kernel: PagedDecodeKernel
    tables: torch.Tensor  # every decode's block ids, concatenated, int64
    table_starts: torch.Tensor  # (B,) int64: where each decode's ids start in `tables`
    lens: torch.Tensor  # (B,) int64: context lengths, own token included
    # Whether `kernel.check_indices` has passed these (the runner does it once a step).
    indices_checked: bool = False


@dataclass(frozen=True)
class AttentionParams:
    """What one layer's attention call receives from the model besides its tensors."""

    scaling: float
    sliding_window: int | None
    softcap: float | None


@dataclass
class PagedAttentionMetadata:
    """Everything attention needs about one step; built once by the runner, read by every
    layer. Masks are derived lazily and shared by the layers with the same window."""

    # Per layer: keys and values, (2, num_blocks, block_size, kv_heads, head_dim).
    kv_caches: list[torch.Tensor]
    # Cache slot (block * block_size + offset) of every packed token.
    slot_mapping: torch.Tensor  # (T,) long
    # The first packed tokens are single-token sequences, one each: their blocks (enough
    # for their context) and context lengths (their own token included).
    decode_tables: list[torch.Tensor] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)
    # Set on a CPU when the native kernel is built (float32): it reads each decode's context
    # in place from the cache blocks instead of gathering a copy.
    native_decode: NativeDecode | None = None
    # Set on accelerators, where one big call beats many small ones: the decode tables
    # padded into one (B, max_blocks) tensor with block 0, and the lengths as a tensor.
    decode_batch: tuple[torch.Tensor, torch.Tensor] | None = None
    # With `decode_batch`: a kernel that reads each decode's blocks in place up to its length
    # instead of the padded gather and mask (`triton_decode.paged_decode`'s signature).
    decode_kernel: Callable[..., None] | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Instead of `prefills`, where the varlen kernel runs: the chunks as one batch, and the
    # kernel (`triton_prefill.paged_prefill`'s signature).
    prefill_batch: PrefillBatch | None = None
    prefill_kernel: Callable[..., None] | None = None
    # Set to a dict to record each layer's `AttentionParams` by layer index during the step
    # (how the fused CPU step learns what transformers passes each layer).
    recorded: dict[int, AttentionParams] | None = None
    _masks: dict[tuple[int, int | None], torch.Tensor | None] = field(default_factory=dict)

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """(B, 1, 1, max_len) bool: the padded key positions each batched decode attends."""
        key = (-1, sliding_window)
        mask = self._masks.get(key)
        if mask is None:
            assert self.decode_batch is not None
            tables, lens = self.decode_batch
            max_len = tables.shape[1] * self.kv_caches[0].shape[2]
            positions = torch.arange(max_len, device=lens.device)[None, :]
            mask = positions < lens[:, None]
            if sliding_window is not None:
                mask &= positions >= lens[:, None] - sliding_window
            mask = self._masks[key] = mask[:, None, None, :]
        return mask

    def prefill_mask(self, index: int, sliding_window: int | None) -> torch.Tensor | None:
        """(chunk_len, context_len) bool for chunk `index`, or None when plain causal
        attention over the chunk alone is exact (no earlier context, no window)."""
        key = (index, sliding_window)
        if key not in self._masks:
            chunk = self.prefills[index]
            n = chunk.token_end - chunk.token_start
            start = chunk.context_start
            mask = None
            if start or (sliding_window is not None and sliding_window < n):
                device = self.slot_mapping.device
                q_pos = torch.arange(start, start + n, device=device)[:, None]
                k_pos = torch.arange(start + n, device=device)[None, :]
                mask = k_pos <= q_pos
                if sliding_window is not None:
                    mask &= k_pos > q_pos - sliding_window
            self._masks[key] = mask
        return self._masks[key]


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, H, T, D)
    key: torch.Tensor,  # (1, KV, T, D)
    value: torch.Tensor,  # (1, KV, T, D)
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    paged_metadata: PagedAttentionMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    if paged_metadata is None:
        raise RuntimeError(
            f"{ATTENTION_NAME} attention needs the step's paged_metadata; this model is "
            "meant to be run by backends.llm.model_runner.ModelRunner"
        )
    meta = paged_metadata
    kv_cache = meta.kv_caches[module.layer_idx]  # type: ignore[index]
    _, num_blocks, _, num_kv_heads, head_dim = kv_cache.shape
    num_heads = query.shape[1]
    if scaling is None:
        scaling = head_dim**-0.5
    if meta.recorded is not None:
        meta.recorded[module.layer_idx] = AttentionParams(scaling, sliding_window, softcap)  # type: ignore[index]

    # Write the step's K/V into the cache before anything reads it.
    slots = kv_cache.view(2, -1, num_kv_heads, head_dim)
    slots[0].index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))  # (T, KV, D)
    slots[1].index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))
    blocks = kv_cache.view(2, num_blocks, -1)  # a block's keys (values) as one row

    out = query.new_empty(query.shape[2], num_heads, head_dim)  # (T, H, D)
    if meta.decode_batch is not None and meta.decode_kernel is not None:
        tables, lens = meta.decode_batch
        meta.decode_kernel(query, kv_cache, tables, lens, out, scaling, sliding_window, softcap)
    elif meta.decode_batch is not None:
        _decode_batched(meta, query, blocks, out, scaling, sliding_window, softcap)
    elif meta.native_decode is not None:
        _decode_native(meta.native_decode, kv_cache, query, out, scaling, sliding_window, softcap)
    elif meta.decode_lens:
        _decode_each(meta, query, blocks, out, scaling, sliding_window, softcap)

    if meta.prefill_batch is not None and meta.prefill_kernel is not None:
        batch = meta.prefill_batch
        meta.prefill_kernel(query, kv_cache, batch, out, scaling, sliding_window, softcap)
    elif meta.prefills:
        prefill_chunks(meta, kv_cache, query, key, value, out, scaling, sliding_window, softcap)
    return out.unsqueeze(0), None


def prefill_chunks(
    meta: PagedAttentionMetadata,
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, KV, D), the step's K/V written
    query: torch.Tensor,  # (1, H, T, D)
    key: torch.Tensor | None,  # (1, KV, T, D); None: a chunk's own K/V are read from the cache
    value: torch.Tensor | None,
    out: torch.Tensor,  # (T, H, D): the chunks' rows are written
    scaling: float,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """Each of `meta.prefills` in one SDPA call over its context (the torch path, and the
    reference `triton_prefill.paged_prefill` is tested against)."""
    _, num_blocks, _, num_kv_heads, head_dim = kv_cache.shape
    blocks = kv_cache.view(2, num_blocks, -1)  # a block's keys (values) as one row
    for i, chunk in enumerate(meta.prefills):
        t0, t1 = chunk.token_start, chunk.token_end
        q = query[:, :, t0:t1]  # (1, H, n, D)
        prefill_mask = meta.prefill_mask(i, sliding_window)
        if prefill_mask is None and key is not None and value is not None:
            k, v = key[:, :, t0:t1], value[:, :, t0:t1]  # (1, KV, n, D)
        else:
            context_len = chunk.context_start + t1 - t0
            context = blocks.index_select(1, chunk.block_table)
            context = context.view(2, -1, num_kv_heads, head_dim)[:, :context_len]
            k, v = context[0].transpose(0, 1)[None], context[1].transpose(0, 1)[None]
        o = _attend(q, k, v, prefill_mask, scaling, softcap)
        out[t0:t1] = o[0].transpose(0, 1)  # (n, H, D)


def _decode_each(
    meta: PagedAttentionMetadata,
    query: torch.Tensor,  # (1, H, T, D)
    blocks: torch.Tensor,  # (2, num_blocks, block_size * KV * D)
    out: torch.Tensor,  # (T, H, D)
    scaling: float,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """Each decode over exactly its own context: no padding, no mask (the CPU path)."""
    b, (num_heads, head_dim) = len(meta.decode_lens), out.shape[1:]
    num_kv_heads = meta.kv_caches[0].shape[3]
    group = num_heads // num_kv_heads
    # (B, KV, G, D), scaled once for all decodes.
    queries = query[0, :, :b].transpose(0, 1).reshape(b, num_kv_heads, group, head_dim)
    queries = queries * scaling
    attended = out[:b].view(b, num_kv_heads, group, head_dim)
    tables, lens = meta.decode_tables, meta.decode_lens
    args = (queries, blocks, tables, lens, attended, sliding_window, softcap)
    cores = torch.get_num_threads()
    # The per-sequence ops are too small for torch's intra-op threads: an OpenMP team meeting
    # at a barrier after each one makes them 2-3x slower than one thread. So they run on one
    # thread, and with more than one core two Python threads share the sequences (the ops
    # release the GIL), interleaved so both get long and short ones.
    with single_threaded():
        if b < _SPLIT_MIN_DECODES or cores < 2:
            _decode_rows(range(b), *args)
            return
        helper = _helper().submit(_decode_rows_in_inference_mode, range(1, b, 2), *args)
        try:
            _decode_rows(range(0, b, 2), *args)
        finally:
            helper.result()


# Below this many decodes a second thread costs more than it saves.
_SPLIT_MIN_DECODES = 8
_helper_pool: ThreadPoolExecutor | None = None


def _helper() -> ThreadPoolExecutor:
    global _helper_pool
    if _helper_pool is None:
        _helper_pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="paged-attention",
            initializer=set_this_thread,
            initargs=(1,),
        )
    return _helper_pool


def _decode_rows(
    rows: range,
    queries: torch.Tensor,  # (B, KV, G, D), scaled
    blocks: torch.Tensor,  # (2, num_blocks, block_size * KV * D)
    tables: list[torch.Tensor],
    lens: list[int],
    attended: torch.Tensor,  # (B, KV, G, D), written
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    num_kv_heads, _, head_dim = queries.shape[1:]
    for j in rows:
        n = lens[j]
        context = blocks.index_select(1, tables[j]).view(2, -1, num_kv_heads, head_dim)[:, :n]
        if sliding_window is not None and n > sliding_window:
            context = context[:, n - sliding_window :]
        keys, values = context[0].transpose(0, 1), context[1].transpose(0, 1)  # (KV, n, D)
        scores = torch.matmul(queries[j], keys.transpose(1, 2))  # (KV, G, n)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        torch.matmul(scores.softmax(dim=-1), values, out=attended[j])


def _decode_rows_in_inference_mode(*args: Any) -> None:
    with torch.inference_mode():  # grad mode is per thread; the caller's is not inherited
        _decode_rows(*args)


def _decode_native(
    native: NativeDecode,
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, KV, D)
    query: torch.Tensor,  # (1, H, T, D)
    out: torch.Tensor,  # (T, H, D)
    scaling: float,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """Each decode over its own context, read in place by the native kernel (the CPU path
    for float32). A threaded build spreads the rows over torch's OpenMP threads itself;
    otherwise, with more than one core, two Python threads share them (the call releases
    the GIL), interleaved so both get long and short ones."""
    b, (num_heads, head_dim) = len(native.lens), out.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    queries = query[0, :, :b].transpose(0, 1).reshape(b, num_kv_heads, group, head_dim)
    queries = (queries * scaling).contiguous()
    attended = out[:b].view(b, num_kv_heads, group, head_dim)

    def rows(selected: range | None, threads: int = 1) -> None:
        native.kernel(
            queries,
            kv_cache,
            native.tables,
            native.table_starts,
            native.lens,
            attended,
            rows=selected,
            threads=threads,
            sliding_window=sliding_window,
            softcap=softcap,
            indices_checked=native.indices_checked,
        )

    cores = torch.get_num_threads()
    if native.kernel.threaded:  # rows spread over torch's own OpenMP threads
        rows(None, cores)
        return
    if b < _SPLIT_MIN_DECODES or cores < 2:
        rows(None)
        return
    helper = _helper().submit(rows, range(1, b, 2))
    try:
        rows(range(0, b, 2))
    finally:
        helper.result()


def _decode_batched(
    meta: PagedAttentionMetadata,
    query: torch.Tensor,  # (1, H, T, D)
    blocks: torch.Tensor,  # (2, num_blocks, block_size * KV * D)
    out: torch.Tensor,  # (T, H, D)
    scaling: float,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """All decodes in one padded, masked call (the accelerator path)."""
    assert meta.decode_batch is not None
    tables, _ = meta.decode_batch
    b, (num_heads, head_dim) = tables.shape[0], out.shape[1:]
    num_kv_heads = meta.kv_caches[0].shape[3]
    q = query[0, :, :b].transpose(0, 1).reshape(b, num_kv_heads, -1, head_dim)  # (B, KV, G, D)
    context = blocks.index_select(1, tables.view(-1)).view(2, b, -1, num_kv_heads, head_dim)
    keys, values = context[0].transpose(1, 2), context[1].transpose(1, 2)  # (B, KV, L, D)
    o = _attend(q, keys, values, meta.decode_mask(sliding_window), scaling, softcap)
    out[:b] = o.reshape(b, num_heads, head_dim)


def _attend(
    q: torch.Tensor,  # (N, H, Lq, D)
    k: torch.Tensor,  # (N, KV, Lk, D)
    v: torch.Tensor,
    mask: torch.Tensor | None,  # bool, broadcastable to (N, H, Lq, Lk); None: causal
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attention of `q` over `k`/`v`; a None mask means causal (query i sees keys <= i).
    Each group of H / KV consecutive query heads shares one K/V head."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=True
        )
    if k.shape[1] != q.shape[1]:
        repeats = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def register() -> None:
    """Make `ATTENTION_NAME` a valid `attn_implementation` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
