"""The paged attention function against plain dense attention: decodes and prefill chunks
(with and without earlier context) in one packed step, grouped-query heads, sliding windows,
soft-capping, and both decode paths (per sequence; batched)."""

from __future__ import annotations

import pytest
import torch

from backends.llm.attention import PagedAttentionMetadata, PrefillChunk, paged_attention

KV, H, D, BS = 2, 4, 8, 4
NUM_BLOCKS = 128


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
    k = k.repeat_interleave(H // KV, dim=1)  # (L, H, D)
    v = v.repeat_interleave(H // KV, dim=1)
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


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("decode_path", ["each", "batched"])
def test_packed_step_equals_dense_attention(
    window: int | None, softcap: float | None, decode_path: str
) -> None:
    check_step(MIXED, window, softcap, batched=decode_path == "batched")


def test_many_decodes_shared_by_two_threads_equal_dense_attention() -> None:
    plan = [(n, 1) for n in (3, 50, 17, 4, 33, 8, 21, 2, 40, 12, 5, 29)] + [(0, 7)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the per-sequence decodes split over two threads
    try:
        check_step(plan, 6, None, batched=False)
    finally:
        torch.set_num_threads(threads)


def check_step(
    plan: list[tuple[int, int]], window: int | None, softcap: float | None, *, batched: bool
) -> None:
    """Run one packed step of `plan` through paged attention; compare with dense."""
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
    batch = None
    if batched:
        width = max(len(tb) for tb in tables)
        padded = torch.stack([torch.cat([tb, tb.new_zeros(width - len(tb))]) for tb in tables])
        batch = (padded, torch.tensor(lens))
    meta = PagedAttentionMetadata(
        kv_caches=[kv_cache],
        slot_mapping=slot_mapping,
        decode_tables=tables,
        decode_lens=lens,
        decode_batch=batch,
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
    x = torch.zeros(1, H, 1, D)
    with pytest.raises(RuntimeError, match="paged_metadata"):
        paged_attention(Layer(), x, x[:, :KV], x[:, :KV], None)
