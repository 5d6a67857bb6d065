"""Paged attention as a transformers attention function, so any supported decoder runs as is.

`register()` adds `paged_attention` to transformers' `AttentionInterface` under
`ATTENTION_NAME`; a model loaded with `attn_implementation=ATTENTION_NAME` then calls it from
every attention layer with that layer's query, key and value for the step's packed batch
(all scheduled tokens of all sequences as one `(1, T)` row), its `scaling`, `sliding_window`
and `softcap`. transformers builds no mask for an unknown implementation; the per-step
`PagedAttentionMetadata` arrives as the `paged_metadata` keyword of the model's forward.

Per layer: the step's new K/V are written into the paged cache through the slot mapping (all
of them, before any read, so sequences scheduled together may share freshly filled prefix
blocks). Then single-token sequences (decodes) attend in a few batched calls, one per group
of similar context lengths (the runner groups them so padding stays small): each group's
blocks are gathered whole, padded to the group's longest context and masked. Each longer
chunk (a prompt, or a recomputation) attends over its own context; a chunk with no earlier
context reads its fresh K/V directly with a causal kernel. Grouped-query attention never
repeats K/V per query head: decode queries are viewed as `(batch, kv_heads, group, D)`, and
chunks use SDPA's `enable_gqa`. Soft-capped layers (Gemma 2) take an explicit path, since
SDPA cannot cap logits. The same code runs on CUDA, where SDPA picks its fused kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTENTION_NAME = "hub_paged"


@dataclass
class DecodeGroup:
    """Single-token sequences of similar context length, batched in one attention call."""

    # Their tokens are `[token_start, token_end)` of the packed batch, one per sequence.
    token_start: int
    token_end: int
    block_tables: torch.Tensor  # (B, max_blocks) long, padded with block 0
    context_lens: torch.Tensor  # (B,) long: keys each token attends, itself included


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


@dataclass
class PagedAttentionMetadata:
    """Everything attention needs about one step; built once by the runner, read by every
    layer. Masks are derived lazily and shared by the layers with the same window."""

    # Per layer: key and value caches, each (num_blocks, block_size, kv_heads, head_dim).
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    # Cache slot (block * block_size + offset) of every packed token.
    slot_mapping: torch.Tensor  # (T,) long
    # Decode tokens come first in the packed batch, group after group.
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    _masks: dict[tuple[str, int, int | None], torch.Tensor | None] = field(default_factory=dict)

    def decode_mask(self, index: int, sliding_window: int | None) -> torch.Tensor:
        """(B, 1, 1, max_len) bool: the padded key positions group `index` attends."""
        key = ("decode", index, sliding_window)
        mask = self._masks.get(key)
        if mask is None:
            group = self.decode_groups[index]
            block_size = self.kv_caches[0][0].shape[1]
            max_len = group.block_tables.shape[1] * block_size
            positions = torch.arange(max_len, device=self.slot_mapping.device)[None, :]
            lens = group.context_lens[:, None]
            mask = positions < lens
            if sliding_window is not None:
                mask &= positions >= lens - sliding_window
            mask = mask[:, None, None, :]
            self._masks[key] = mask
        return mask

    def prefill_mask(self, index: int, sliding_window: int | None) -> torch.Tensor | None:
        """(chunk_len, context_len) bool for chunk `index`, or None when plain causal
        attention over the chunk alone is exact (no earlier context, no window)."""
        key = ("prefill", index, sliding_window)
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
    k_cache, v_cache = meta.kv_caches[module.layer_idx]  # type: ignore[index]
    num_blocks, _, num_kv_heads, head_dim = k_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    if scaling is None:
        scaling = head_dim**-0.5

    # Write the step's K/V into the cache before anything reads it.
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)  # (T, KV, D)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k_new)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v_new)
    k_blocks, v_blocks = k_cache.view(num_blocks, -1), v_cache.view(num_blocks, -1)

    out = query.new_empty(query.shape[2], num_heads, head_dim)  # (T, H, D)
    tokens = query[0].transpose(0, 1)  # (T, H, D)
    for i, g in enumerate(meta.decode_groups):
        t0, t1 = g.token_start, g.token_end
        b = t1 - t0
        q = tokens[t0:t1].reshape(b, num_kv_heads, group, head_dim)
        flat = g.block_tables.view(-1)
        keys = k_blocks.index_select(0, flat).view(b, -1, num_kv_heads, head_dim)
        values = v_blocks.index_select(0, flat).view(b, -1, num_kv_heads, head_dim)
        mask = meta.decode_mask(i, sliding_window)
        o = _attend(q, keys.transpose(1, 2), values.transpose(1, 2), mask, scaling, softcap)
        out[t0:t1] = o.reshape(b, num_heads, head_dim)  # (B, KV, G, D) -> (B, H, D)

    for i, chunk in enumerate(meta.prefills):
        t0, t1 = chunk.token_start, chunk.token_end
        q = query[:, :, t0:t1]  # (1, H, n, D)
        prefill_mask = meta.prefill_mask(i, sliding_window)
        if prefill_mask is None:
            k, v = key[:, :, t0:t1], value[:, :, t0:t1]  # (1, KV, n, D)
        else:
            context = prefill_mask.shape[1]
            table = chunk.block_table
            k = k_blocks.index_select(0, table).view(-1, num_kv_heads, head_dim)[:context]
            v = v_blocks.index_select(0, table).view(-1, num_kv_heads, head_dim)[:context]
            k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, KV, ctx, D)
        o = _attend(q, k, v, prefill_mask, scaling, softcap, gqa=True)
        out[t0:t1] = o[0].transpose(0, 1)  # (n, H, D)
    return out.unsqueeze(0), None


def _attend(
    q: torch.Tensor,  # (N, H, Lq, D)
    k: torch.Tensor,  # (N, KV, Lk, D)
    v: torch.Tensor,
    mask: torch.Tensor | None,  # bool, broadcastable to (N, H, Lq, Lk); None: causal
    scaling: float,
    softcap: float | None,
    *,
    gqa: bool = False,
) -> torch.Tensor:
    """Attention of `q` over `k`/`v`; a None mask means causal (query i sees keys <= i).
    With `gqa`, each group of H / KV consecutive query heads shares one K/V head."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=gqa
        )
    if gqa and k.shape[1] != q.shape[1]:
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
