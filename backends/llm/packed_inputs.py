"""A step's tokens packed for the transformers modules: one `(1, T)` row of every scheduled
token with its position and cache slot, each decode's block table, the prompt chunks as the
varlen prefill kernel or the per-chunk torch path reads them, and the rows whose logits are
kept. Single tokens come first, then the chunks: the scheduler's order is the packing order.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from backends.llm import triton_decode, triton_prefill
from backends.llm.attention import NativeDecode, PagedAttentionMetadata, PrefillChunk
from backends.llm.scheduler import SchedulerOutput
from backends.llm.sequence import Sequence
from backends.llm.speculative.verify import sampling_rows

if TYPE_CHECKING:
    from backends.llm.model_runner import ModelRunner


@dataclass(frozen=True, slots=True)
class StepInputs:
    """What the model's forward takes for one step, and which sequences sample from it."""

    input_ids: torch.Tensor  # (1, T)
    positions: torch.Tensor  # (1, T)
    logits_indices: torch.Tensor  # (S,): the packed index of each sampling sequence's token
    metadata: PagedAttentionMetadata
    sampling_seqs: list[Sequence]
    # Runs of packed tokens with one adapter each (None: the base), in packing order.
    adapter_segments: list[tuple[str | None, int]]


def packed_inputs(runner: ModelRunner, output: SchedulerOutput) -> StepInputs:
    """The inputs of `output`'s step through `runner`'s model (its device, cache, kernels)."""
    bs = runner.block_size
    device = runner.device
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    last_token: dict[int, int] = {}  # seq_id -> packed index of its last token

    decode_blocks: list[int] = []  # every decode's table, concatenated
    decode_widths: list[int] = []
    decode_lens: list[int] = []
    for item in output.scheduled:
        if item.num_tokens != 1:
            continue
        seq, pos = item.seq, item.start
        last_token[seq.seq_id] = len(token_ids)
        token_ids.append(seq.token_ids[pos])
        positions.append(pos)
        slots.append(seq.block_ids[pos // bs] * bs + pos % bs)
        decode_lens.append(pos + 1)
        decode_blocks.extend(seq.block_ids[: pos // bs + 1])
        decode_widths.append(pos // bs + 1)
    # One tensor for all tables (views of it cost less than a tensor per sequence).
    all_tables = torch.tensor(decode_blocks, dtype=torch.long, device=device)

    # The chunks: one varlen batch for the kernel where it runs, else one each.
    prefill_kernel = None
    if any(item.num_tokens != 1 for item in output.scheduled):
        shape = (runner.config.num_attention_heads, runner.kv_heads, runner.head_dim, bs)
        prefill_kernel = triton_prefill.kernel_for(device, runner.dtype, shape)
    prefills: list[PrefillChunk] = []
    query_starts, context_starts, chunk_tables = [len(token_ids)], [], []
    for item in output.scheduled:
        if item.num_tokens == 1:
            continue
        seq, start, end = item.seq, item.start, item.start + item.num_tokens
        t0 = len(token_ids)
        table = seq.block_ids
        token_ids.extend(seq.token_ids[start:end])
        token_ids.extend(item.drafts)  # past the sequence's tokens: the chunk's end
        positions.extend(range(start, end))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        last_token[seq.seq_id] = len(token_ids) - 1
        if prefill_kernel is not None:
            query_starts.append(len(token_ids))
            context_starts.append(start)
            chunk_tables.append(table[: -(-end // bs)])
            continue
        blocks = torch.tensor(table[: -(-end // bs)], dtype=torch.long, device=device)
        prefills.append(PrefillChunk(t0, len(token_ids), start, blocks))
    prefill_batch = None
    if prefill_kernel is not None:
        prefill_batch = triton_prefill.PrefillBatch.build(
            query_starts, context_starts, chunk_tables, device
        )

    decode_batch = native = decode_kernel = None
    decode_tables: list[torch.Tensor] = []
    batched = runner.batched_decode
    if batched is None:
        batched = runner.device.type != "cpu"
    kernel = runner._native_kernel() if not batched else None
    if kernel is not None and decode_lens:
        starts = [0, *itertools.accumulate(decode_widths[:-1])]
        # Once a step, on the lists (no tensor ops), so that every layer's call skips it.
        kernel.check_index_lists(decode_blocks, starts, decode_lens, runner.num_blocks, bs)
        starts_t = torch.tensor(starts, dtype=torch.long)
        lens_t = torch.tensor(decode_lens, dtype=torch.long)
        native = NativeDecode(kernel, all_tables, starts_t, lens_t, indices_checked=True)
    elif batched and decode_lens:
        width = max(decode_widths)
        rows = [row + [0] * (width - len(row)) for row in _split(decode_blocks, decode_widths)]
        decode_batch = (
            torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(decode_lens, dtype=torch.long, device=device),
        )
        decode_kernel = triton_decode.kernel_for(device)
    elif decode_lens:  # the torch path reads each decode's own table
        decode_tables = list(all_tables.split(decode_widths))

    sampling = sampling_rows(output.scheduled)
    logits_indices: list[int] = []
    for item in output.scheduled:
        if item.sample:  # a row at the last token, and one at each draft after it
            last = last_token[item.seq.seq_id]
            logits_indices.extend(range(last - len(item.drafts), last + 1))
    # The scheduler's order (single tokens first, then the chunks) is the packing order.
    segments = [(item.seq.adapter, item.num_tokens) for item in output.scheduled]
    metadata = PagedAttentionMetadata(
        kv_caches=runner.kv_caches,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        decode_tables=decode_tables,
        decode_batch=decode_batch,
        decode_kernel=decode_kernel,
        native_decode=native,
        decode_lens=decode_lens,
        prefills=prefills,
        prefill_batch=prefill_batch,
        prefill_kernel=prefill_kernel,
    )
    return StepInputs(
        input_ids=torch.tensor([token_ids], dtype=torch.long, device=device),
        positions=torch.tensor([positions], dtype=torch.long, device=device),
        logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
        metadata=metadata,
        sampling_seqs=sampling,
        adapter_segments=segments,
    )


def _split(values: list[int], widths: list[int]) -> list[list[int]]:
    out, start = [], 0
    for width in widths:
        out.append(values[start : start + width])
        start += width
    return out
