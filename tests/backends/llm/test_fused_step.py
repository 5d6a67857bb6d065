"""A scheduler step as the fused kernel's rows, and which steps take the kernel: torch-free."""

from __future__ import annotations

import pytest

from backends.llm.fused.step import MAX_CHUNK_ATTENTION, fused_rows, runs_fused
from backends.llm.sampling_params import SamplingParams
from backends.llm.scheduler import ScheduledSequence, SchedulerOutput
from backends.llm.sequence import Sequence

# Torch-free: also run in a bare environment (make test-pure).
pytestmark = pytest.mark.pure

BLOCK = 4


def sequence(
    seq_id: int, tokens: list[int], blocks: list[int], adapter: str | None = None
) -> Sequence:
    seq = Sequence(
        seq_id,
        f"r{seq_id}",
        tokens,
        SamplingParams(),
        max_tokens=8,
        block_size=BLOCK,
        adapter=adapter,
    )
    seq.block_ids = blocks
    return seq


def output(*items: ScheduledSequence) -> SchedulerOutput:
    return SchedulerOutput(list(items), sum(i.num_tokens for i in items))


def test_rows_follow_the_packing_order_each_with_its_own_context() -> None:
    decode = sequence(1, list(range(10, 16)), [7, 3])  # 6 tokens, the last one new
    chunk = sequence(2, list(range(50, 60)), [5, 9, 2])  # tokens 4..8 this step, more to come
    step = fused_rows(
        [ScheduledSequence(decode, 5, 1, True), ScheduledSequence(chunk, 4, 5, False)], BLOCK
    )
    assert step.tokens == [15, 54, 55, 56, 57, 58]
    assert step.positions == [5, 4, 5, 6, 7, 8]
    # Position p lives in block table[p // 4] at offset p % 4.
    assert step.slots == [3 * 4 + 1, 9 * 4 + 0, 9 * 4 + 1, 9 * 4 + 2, 9 * 4 + 3, 2 * 4 + 0]
    # Each sequence's table once, as far as its last position needs; every row points at it.
    assert step.tables == [7, 3, 5, 9, 2]
    assert step.table_starts == [0, 2, 2, 2, 2, 2]
    # A row sees its sequence up to and including itself: causal within the chunk.
    assert step.lens == [6, 5, 6, 7, 8, 9]
    assert step.sample_rows == [0]  # the chunk does not sample: its prompt goes on


def test_sample_rows_are_the_last_row_of_each_sampling_item_in_order() -> None:
    a = sequence(1, [1, 2, 3], [0])
    b = sequence(2, [4, 5, 6, 7, 8], [1, 2])
    step = fused_rows([ScheduledSequence(a, 2, 1, True), ScheduledSequence(b, 0, 5, True)], BLOCK)
    assert step.sample_rows == [0, 5]
    assert step.tables == [0, 1, 2]


def test_which_steps_run_fused() -> None:
    decodes = [
        ScheduledSequence(sequence(i, [1] * 9, [i, 10 + i, 20 + i]), 8, 1, True) for i in range(8)
    ]
    assert runs_fused(output(*decodes), max_rows=512)
    assert not runs_fused(output(*decodes), max_rows=4)  # more tokens than the kernel's rows
    adapter = ScheduledSequence(sequence(9, [1] * 9, [40, 41, 42], adapter="a@1"), 8, 1, True)
    assert not runs_fused(output(*decodes, adapter), max_rows=512)  # LoRA: transformers
    # A chunk whose rows would read their context too many times: SDPA shares key tiles.
    side = int(MAX_CHUNK_ATTENTION**0.5)
    fits = ScheduledSequence(sequence(10, [1] * side, list(range(side // BLOCK))), 0, side, True)
    assert runs_fused(output(*decodes, fits), max_rows=10**6)
    late = ScheduledSequence(sequence(11, [1] * 4 * side, list(range(side))), 3 * side, side, True)
    assert not runs_fused(output(late), max_rows=10**6)
