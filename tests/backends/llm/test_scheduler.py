"""The scheduler and KV-cache manager together, driven by a torch-free fake runner that
checks every sequence reads exactly its own context through its block table."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from backends.llm.kv_cache_manager import KVCacheManager
from backends.llm.sampling_params import SamplingParams
from backends.llm.scheduler import Scheduler, SchedulerLimits
from backends.llm.sequence import FinishReason, Sequence
from tests.backends.llm.fake_runner import EOS, FakeRunner, next_token, run

# Torch-free: also run in a bare environment (make test-pure).
pytestmark = pytest.mark.pure

REPO_ROOT = Path(__file__).resolve().parents[3]
GREEDY = SamplingParams(temperature=0.0)


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 256,
    aging: int = 1000,
    prefix_caching: bool = True,
) -> tuple[Scheduler, FakeRunner]:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    limits = SchedulerLimits(max_num_seqs, max_num_batched_tokens, max_model_len, aging)
    return Scheduler(limits, kv, [EOS]), FakeRunner(block_size)


_ids = iter(range(10**9))


def seq(prompt: list[int], max_tokens: int = 8, *, priority: int = 0, index: int = 0) -> Sequence:
    return Sequence(
        next(_ids),
        f"r{prompt[0]}-{len(prompt)}",
        prompt,
        GREEDY,
        max_tokens=max_tokens,
        block_size=4,
        index=index,
        priority=priority,
    )


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def prompts(count: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 50) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def test_scheduler_and_block_manager_never_import_torch() -> None:
    code = (
        "import sys, backends.llm.scheduler, backends.llm.kv_cache_manager;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


def test_every_step_respects_the_token_budget_and_sequence_cap() -> None:
    scheduler, runner = make(max_num_seqs=3, max_num_batched_tokens=16)
    seqs = [seq(p, 6) for p in prompts(10)]
    for s in seqs:
        scheduler.add(s)
    run(scheduler, runner)
    for output in runner.outputs:
        assert output.num_batched_tokens == sum(i.num_tokens for i in output.scheduled) <= 16
        assert len(output.scheduled) <= 3
    for s in seqs:
        assert s.output_token_ids == expected(s.token_ids[: s.num_prompt_tokens], 6)
        assert s.finish_reason is FinishReason.LENGTH
    assert scheduler.kv_cache.pool.num_used_blocks == 0


def test_a_long_prompt_is_chunked_and_mixed_with_decodes() -> None:
    scheduler, runner = make(max_num_batched_tokens=16)
    short = seq([5, 6, 7], 20)
    scheduler.add(short)
    first = scheduler.schedule()
    scheduler.update(first, runner.execute(first))
    long = seq(list(range(3, 48)), 4)  # 45 tokens, three chunks of at most 15
    scheduler.add(long)
    run(scheduler, runner)
    mixed = [
        o
        for o in runner.outputs
        if {i.seq.seq_id for i in o.scheduled} == {short.seq_id, long.seq_id}
    ]
    chunks = [i for o in mixed for i in o.scheduled if i.seq is long and not i.sample]
    assert len(chunks) >= 2, "the long prompt should take several steps"
    assert all(any(i.seq is short and i.num_tokens == 1 for i in o.scheduled) for o in mixed)
    assert long.output_token_ids == expected(list(range(3, 48)), 4)


def test_sequences_with_a_common_prefix_share_its_blocks() -> None:
    scheduler, runner = make()
    base = list(range(3, 23))  # 20 tokens: five full blocks
    a, b = seq([*base, 30], 4), seq([*base, 31, 32], 4)
    scheduler.add(a)
    run(scheduler, runner)
    scheduler.add(b)
    run(scheduler, runner)
    assert b.num_cached_tokens == 20
    assert scheduler.kv_cache.prefix_hits == 20
    assert a.output_token_ids == expected([*base, 30], 4)
    assert b.output_token_ids == expected([*base, 31, 32], 4)


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    scheduler, runner = make()
    prompt = list(range(3, 19))  # exactly four blocks
    first, second = seq(prompt, 3), seq(prompt, 3)
    scheduler.add(first)
    run(scheduler, runner)
    scheduler.add(second)
    run(scheduler, runner)
    assert second.num_cached_tokens == 12  # three blocks; the fourth holds the last token
    assert second.output_token_ids == first.output_token_ids


def test_samples_of_one_request_share_prompt_blocks_in_the_same_step() -> None:
    scheduler, runner = make()
    prompt = list(range(3, 20))
    samples = [seq(prompt, 5, index=i) for i in range(3)]
    for s in samples:
        scheduler.add(s)
    first = scheduler.schedule()
    # The first sample computes the prompt; the others share its blocks but the last.
    assert sorted(i.num_tokens for i in first.scheduled) == [1, 1, 17]
    scheduler.update(first, runner.execute(first))
    run(scheduler, runner)
    assert all(s.output_token_ids == expected(prompt, 5) for s in samples)


def test_out_of_blocks_preempts_the_latest_arrival_and_everything_still_finishes() -> None:
    # 12 blocks of 4 tokens: three sequences of ~40 tokens cannot all stay resident.
    scheduler, runner = make(num_blocks=12, max_num_batched_tokens=64)
    seqs = [seq(p, 16) for p in prompts(3, seed=3, lo=10, hi=14)]
    for s in seqs:
        scheduler.add(s)
    run(scheduler, runner)
    assert scheduler.num_preemptions > 0
    assert seqs[0].num_preemptions == 0, "the earliest arrival is never the victim"
    for s in seqs:
        assert s.output_token_ids == expected(s.token_ids[: s.num_prompt_tokens], 16)
    assert scheduler.kv_cache.pool.num_used_blocks == 0


def test_preemption_takes_the_lowest_priority_first() -> None:
    scheduler, runner = make(num_blocks=12, max_num_batched_tokens=64)
    work = zip(prompts(3, seed=4, lo=10, hi=14), (-1, 0, 5), strict=True)
    urgent, normal, background = (seq(p, 16, priority=priority) for p, priority in work)
    for s in (background, normal, urgent):  # the background request arrives first
        scheduler.add(s)
    run(scheduler, runner)
    assert urgent.num_preemptions == 0
    assert background.num_preemptions >= 1


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    scheduler, runner = make(max_num_seqs=1)
    late_urgent = seq([9, 9, 9], 1, priority=-1)
    early, later = seq([3, 4], 1), seq([5, 6], 1)
    for s in (early, later, late_urgent):
        scheduler.add(s)
    order = []
    while scheduler.num_unfinished:
        output = scheduler.schedule()
        order += [i.seq for i in output.scheduled if i.seq not in order]
        scheduler.update(output, runner.execute(output))
    assert order == [late_urgent, early, later]


def test_a_low_priority_request_is_not_starved_by_a_stream_of_urgent_ones() -> None:
    scheduler, runner = make(max_num_seqs=1, aging=4)
    patient = seq([7, 7, 7], 1, priority=3)
    scheduler.add(patient)
    for step in range(40):
        scheduler.add(seq([8, step + 3], 1, priority=0))
        output = scheduler.schedule()
        scheduler.update(output, runner.execute(output))
        if patient.is_finished:
            break
    assert patient.is_finished, "aging should let the low-priority request run"


def test_stop_conditions() -> None:
    scheduler, runner = make(max_model_len=12)
    capped = seq([3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 50)  # the context ends first
    stop_params = SamplingParams(temperature=0.0, stop_token_ids=(next_token([3, 4]),))
    stopped = Sequence(next(_ids), "s", [3, 4], stop_params, max_tokens=50, block_size=4)
    for s in (capped, stopped):
        scheduler.add(s)
    run(scheduler, runner)
    assert capped.finish_reason is FinishReason.LENGTH and capped.num_tokens == 12
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.stop_reason == next_token([3, 4]) and stopped.num_output_tokens == 1


def test_finish_frees_blocks_of_running_and_waiting_sequences() -> None:
    scheduler, runner = make(max_num_seqs=1)
    running, waiting = seq(list(range(3, 20)), 50), seq([4, 5, 6], 50)
    scheduler.add(running)
    scheduler.add(waiting)
    output = scheduler.schedule()
    scheduler.update(output, runner.execute(output))
    assert scheduler.kv_cache.pool.num_used_blocks > 0
    scheduler.finish(running, FinishReason.ABORT)
    scheduler.finish(waiting, FinishReason.ABORT)
    assert scheduler.num_unfinished == 0
    assert scheduler.kv_cache.pool.num_used_blocks == 0
    assert scheduler.schedule().finished_seq_ids == [running.seq_id, waiting.seq_id]


@pytest.mark.parametrize("num_blocks", [11, 16, 200])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_outputs_do_not_depend_on_memory_pressure(num_blocks: int, prefix_caching: bool) -> None:
    shared = list(range(3, 15))
    work = [shared + p for p in prompts(12, seed=7, lo=1, hi=20)]
    scheduler, runner = make(
        num_blocks, max_num_seqs=6, max_num_batched_tokens=24, prefix_caching=prefix_caching
    )
    seqs = [seq(p, 10) for p in work]
    for s in seqs:
        scheduler.add(s)
    run(scheduler, runner)
    for s, p in zip(seqs, work, strict=True):
        assert s.output_token_ids == expected(p, 10)
    assert scheduler.kv_cache.pool.num_used_blocks == 0
    if num_blocks == 11:
        assert scheduler.num_preemptions > 0


def test_budget_smaller_than_the_sequence_cap_is_refused() -> None:
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(SchedulerLimits(16, 8, 64, 100), kv, [EOS])
