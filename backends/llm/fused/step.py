"""A scheduler step as the fused kernel reads it: one row per token, each with its own context.

Pure Python (no torch): rows are built from the `SchedulerOutput` in its order (single tokens
first, then chunks), the order the transformers path packs them in, so sampling rows line up
with the sampler's sequences either way. A sequence verifying speculative drafts is a short
chunk of its last token and its drafts (past its own tokens), sampled at every row.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.llm.scheduler import ScheduledSequence, SchedulerOutput

# Chunk rows times their context (the keys a chunk's queries read, counted per row) up to
# which a step with prompt chunks still runs fused. The kernel reads a chunk's context once
# per row where transformers' attention (SDPA) shares key tiles between rows; on the
# benchmark Llama the two cost the same near a 512-token chunk from position 0 and the
# fused step wins below that, so the bound keeps a margin (docs/benchmarks.md).
MAX_CHUNK_ATTENTION = 65_536


@dataclass
class FusedStep:
    """One step's tokens as rows: each with its position, cache slot and context (its
    sequence's blocks, at `table_starts[row]` in `tables`, and `lens[row]` tokens, itself
    included); `sample_rows` are the rows whose logits are wanted, in sampling order."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[int]
    table_starts: list[int]
    lens: list[int]
    sample_rows: list[int]


def runs_fused(output: SchedulerOutput, max_rows: int) -> bool:
    """Whether a step should take the fused kernel: at most `max_rows` tokens, no LoRA
    adapter (its per-token deltas are the transformers path's), and prompt chunks short
    enough that reading their context once per row costs less than transformers' attention."""
    if output.num_batched_tokens > max_rows:
        return False
    chunk_attention = 0
    for item in output.scheduled:
        if item.seq.adapter is not None:
            return False
        # A chunk verifying drafts is a few decode rows: each reads its context once on
        # either path, and transformers' takes several times as long for them.
        if item.num_tokens > 1 and not item.drafts:
            chunk_attention += item.num_tokens * (item.start + item.num_tokens)
    return chunk_attention <= MAX_CHUNK_ATTENTION


def fused_rows(scheduled: list[ScheduledSequence], block_size: int) -> FusedStep:
    """The rows of `scheduled` (a step's items, in order); an item with drafts samples at its
    last token and at each draft, in that order (`backends.llm.speculative.verify`)."""
    step = FusedStep([], [], [], [], [], [], [])
    for item in scheduled:
        seq = item.seq
        if item.num_tokens == 1:  # a decode: one row, its table up to its position's block
            pos = item.start
            width = pos // block_size + 1
            step.table_starts.append(len(step.tables))
            step.tables.extend(seq.block_ids[:width])
            step.tokens.append(seq.token_ids[pos])
            step.positions.append(pos)
            step.slots.append(seq.block_ids[width - 1] * block_size + pos % block_size)
            step.lens.append(pos + 1)
            if item.sample:
                step.sample_rows.append(len(step.tokens) - 1)
            continue
        start, end = item.start, item.start + item.num_tokens
        table = seq.block_ids
        table_start = len(step.tables)
        step.tables.extend(table[: -(-end // block_size)])
        step.tokens.extend(seq.token_ids[start : end - len(item.drafts)])
        step.tokens.extend(item.drafts)
        step.positions.extend(range(start, end))
        step.slots.extend(
            table[p // block_size] * block_size + p % block_size for p in range(start, end)
        )
        step.table_starts.extend([table_start] * (end - start))
        step.lens.extend(range(start + 1, end + 1))
        if item.sample:
            last = len(step.tokens) - 1
            step.sample_rows.extend(range(last - len(item.drafts), last + 1))
    return step
