"""Priority classes in the scheduler: a waiting request that outranks running ones by a class
takes their seat, tokens or blocks at once; waiting (not running) ages a request, so batch
work comes back in turn. Torch-free, with the fake runner checking every context read."""

from __future__ import annotations

import pytest

from backends.llm.scheduler import Scheduler
from backends.llm.sequence import Sequence
from backends.priority import PriorityClass
from tests.backends.llm.fake_runner import FakeRunner, run
from tests.backends.llm.test_scheduler import expected, make, prompts, seq

pytestmark = pytest.mark.pure

INTERACTIVE = PriorityClass.INTERACTIVE.level
STANDARD = PriorityClass.STANDARD.level
BATCH = PriorityClass.BATCH.level


def step(scheduler: Scheduler, runner: FakeRunner) -> list[Sequence]:
    """One step; the sequences that got a token."""
    output = scheduler.schedule()
    scheduler.update(output, runner.execute(output))
    return [item.seq for item in output.scheduled if item.sample]


def steps_to_first_token(scheduler: Scheduler, runner: FakeRunner, target: Sequence) -> int:
    count = 0
    while target.num_output_tokens == 0:
        step(scheduler, runner)
        count += 1
        assert count < 1000
    return count


def saturate(scheduler: Scheduler, runner: FakeRunner, count: int, **kw: int) -> list[Sequence]:
    """`count` batch-class requests with long outputs, stepped until all of them decode."""
    batch = [seq(p, 60, priority=BATCH) for p in prompts(count, seed=11, **kw)]
    for s in batch:
        scheduler.add(s)
    full = min(count, scheduler.limits.max_num_seqs)
    while len(scheduler.running) < full or not all(s.num_output_tokens for s in scheduler.running):
        step(scheduler, runner)
    return batch


@pytest.mark.parametrize(
    ("urgency", "preempts"), [(INTERACTIVE, True), (STANDARD, True), (BATCH, False)]
)
def test_a_request_outranking_a_full_running_set_by_a_class_starts_at_the_next_step(
    urgency: int, preempts: bool
) -> None:
    scheduler, runner = make(max_num_seqs=4, max_num_batched_tokens=32)
    batch = saturate(scheduler, runner, 8, lo=3, hi=6)
    urgent = seq([5, 6, 7, 8, 9], 4, priority=urgency)
    scheduler.add(urgent)
    got_token = step(scheduler, runner)
    assert (urgent in got_token) is preempts
    if preempts:
        # The lowest running sequence (latest arrival of the batch class) gave up its seat.
        assert scheduler.num_preemptions == 1
        assert max(s.num_preemptions for s in batch[:4]) == 1
    run(scheduler, runner)
    for s in [*batch, urgent]:
        assert s.output_token_ids == expected(s.token_ids[: s.num_prompt_tokens], s.max_tokens)


def test_outranked_prompt_chunks_yield_the_step_tokens() -> None:
    # A long batch prompt is being chunked through the whole budget when a chat turn comes.
    scheduler, runner = make(num_blocks=128, max_num_batched_tokens=32)
    long_batch = seq(list(range(3, 43)) * 4, 4, priority=BATCH)
    scheduler.add(long_batch)
    step(scheduler, runner)
    chat = seq(prompts(1, seed=5, lo=20, hi=20)[0], 4, priority=INTERACTIVE)
    scheduler.add(chat)
    assert steps_to_first_token(scheduler, runner, chat) == 1  # as on an idle engine
    run(scheduler, runner)
    assert long_batch.output_token_ids == expected(long_batch.token_ids[:160], 4)
    # What the batch prompt had computed came back from the prefix cache.
    assert long_batch.num_cached_tokens > 0


def test_an_outranking_request_takes_blocks_from_the_lowest_running_sequence() -> None:
    # 12 blocks of 4 tokens: two batch sequences of 16-token prompts take 8, and their next
    # decodes two more, leaving 2 of the 4 the chat prompt needs.
    scheduler, runner = make(num_blocks=12, max_num_seqs=8, max_num_batched_tokens=64)
    batch = [seq(p, 20, priority=BATCH) for p in prompts(2, seed=2, lo=16, hi=16)]
    for s in batch:
        scheduler.add(s)
    step(scheduler, runner)
    assert scheduler.kv_cache.pool.num_free_blocks == 4
    chat = seq(prompts(1, seed=9, lo=12, hi=12)[0], 4, priority=INTERACTIVE)
    scheduler.add(chat)
    assert steps_to_first_token(scheduler, runner, chat) == 1
    assert [s.num_preemptions for s in batch] == [0, 1], "the latest batch arrival yields"
    run(scheduler, runner)
    for s in [*batch, chat]:
        assert s.output_token_ids == expected(s.token_ids[: s.num_prompt_tokens], s.max_tokens)


def test_running_does_not_age_a_sequence_out_of_preemption() -> None:
    # Aging every 4 steps: the batch sequences run far longer than that, and still yield.
    scheduler, runner = make(max_num_seqs=2, aging=4)
    saturate(scheduler, runner, 2, lo=3, hi=4)
    for _ in range(20):
        step(scheduler, runner)
    chat = seq([9, 8, 7], 2, priority=INTERACTIVE)
    scheduler.add(chat)
    assert steps_to_first_token(scheduler, runner, chat) == 1


def test_preempted_batch_work_is_not_starved_by_a_stream_of_interactive_requests() -> None:
    scheduler, runner = make(max_num_seqs=2, aging=8)
    batch = seq([4, 4, 4], 30, priority=BATCH)
    scheduler.add(batch)
    for i in range(400):
        # Two interactive requests always wait for the two seats.
        while len(scheduler.waiting) < 3:
            scheduler.add(seq([5 + i % 40, 6, 7], 6, priority=INTERACTIVE))
        step(scheduler, runner)
        if batch.is_finished:
            break
    assert batch.num_preemptions >= 1
    assert batch.is_finished, "aging should bring the batch request back"
    assert batch.output_token_ids == expected([4, 4, 4], 30)
