"""Speculation turns itself down when drafts do not pay for their time: it compares seconds
per emitted token with drafts and without, by batch size, and keeps measuring both sides.
Time is a fake clock advanced by the steps themselves, so nothing here depends on the
machine's speed."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.llm.engine import LLMEngine
from backends.llm.sampling_params import SamplingParams
from backends.llm.scheduler import SchedulerOutput
from backends.llm.sequence import Sequence
from backends.llm.speculative.cost import MIN_SAMPLES, PROBE_EVERY, SpeculationCost
from tests.backends.llm.speculative_support import assert_same, engine, ngram
from tests.backends.llm.support import build_model, random_prompts, run_all


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("speculative-cost-models")


def test_both_sides_are_measured_then_drafts_go_on_while_their_tokens_pay() -> None:
    cost = SpeculationCost()
    choices = []
    for _ in range(2 * MIN_SAMPLES):
        choices.append(cost.speculate(1, expected_tokens=3.0))
        cost.observe(1, choices[-1], 2.0 if choices[-1] else 1.0)  # drafts: twice the time
    assert choices == [False] * MIN_SAMPLES + [True] * MIN_SAMPLES
    assert cost.cost_ratio(1) == 2.0
    later = [cost.speculate(1, expected_tokens=3.0) for _ in range(2 * PROBE_EVERY)]
    assert later.count(False) == 2  # a probe of the plain side now and then
    # Sequences whose drafts land less often: the same cost does not pay.
    fewer = [cost.speculate(1, expected_tokens=1.5) for _ in range(PROBE_EVERY)]
    assert fewer.count(True) == 1  # a probe of the speculative side
    # Another batch size is measured on its own.
    assert cost.cost_ratio(16) is None and cost.speculate(16, expected_tokens=3.0) is False


def test_a_step_the_os_delayed_does_not_decide() -> None:
    cost = SpeculationCost()
    for _ in range(MIN_SAMPLES):
        cost.observe(4, False, 1.0)
        cost.observe(4, True, 1.5)
    cost.observe(4, False, 1000.0)
    cost.observe(4, True, 1000.0)
    assert cost.cost_ratio(4) == 1.5
    assert cost.speculate(4, expected_tokens=2.0) is True


class _Clock:
    """Fake seconds; the runner's steps and the proposer's drafts advance it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _timed_engine(folder: Path, draft_seconds: float) -> LLMEngine:
    """Prompt lookup where every target step takes 1 s and proposing `draft_seconds`."""
    e = engine(folder, ngram(4, max_batch=64, min_acceptance=0.0))
    speculator = e.speculator
    assert speculator is not None
    speculator.cost = SpeculationCost()  # the policy under test
    clock = _Clock()
    speculator.clock = clock
    execute, propose = e.runner.execute, speculator.proposer.propose

    def timed_execute(output: SchedulerOutput) -> object:
        clock.now += 1.0
        return execute(output)

    def timed_propose(seqs: list[Sequence], num_tokens: int) -> list[list[int]]:
        clock.now += draft_seconds
        return propose(seqs, num_tokens)

    e.runner.execute = timed_execute  # type: ignore[method-assign]
    speculator.proposer.propose = timed_propose  # type: ignore[method-assign]
    return e


def test_a_slow_proposer_is_turned_down_a_cheap_one_kept(root: Path) -> None:
    folder = build_model(root, "llama")
    prompt = random_prompts(1, seed=310, lengths=(12, 12))[0]
    # Confined to three tokens: drafts copied from the output land now and then.
    confined = {40: 5.0, 41: 5.0, 42: 5.0}
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True, logit_bias=confined)
    requests = [(prompt, params)]
    base = run_all(engine(folder, None), requests)
    cheap = _timed_engine(folder, 0.0)
    assert_same(base, run_all(cheap, requests))
    slow = _timed_engine(folder, 50.0)
    assert_same(base, run_all(slow, requests))
    cheap_steps = cheap.metrics.speculation.verify_steps
    slow_steps = slow.metrics.speculation.verify_steps
    assert cheap.speculator is not None and slow.speculator is not None
    # A step with drafts costs 1 s of target and 50 s of proposer against 1 s without.
    assert cheap.speculator.cost.cost_ratio(1) == 1.0
    assert slow.speculator.cost.cost_ratio(1) == 51.0
    # The slow proposer only drafts to be measured: its first steps, then a probe now and then.
    assert slow_steps <= MIN_SAMPLES + 96 // PROBE_EVERY + 1 < cheap_steps


def test_a_request_whose_drafts_miss_does_not_turn_the_next_one_down(root: Path) -> None:
    folder = build_model(root, "llama")
    prompt = random_prompts(1, seed=310, lengths=(12, 12))[0]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    [[plain]] = run_all(engine(folder, None), [(prompt, params)])
    e = _timed_engine(folder, 0.5)  # a step with drafts costs 1.5x one without
    speculator = e.speculator
    assert speculator is not None

    def drafts(seqs: list[Sequence], num_tokens: int) -> list[list[int]]:
        """Request "0" drafts what it never says, request "1" exactly what it will say."""
        out = []
        for s in seqs:
            done = s.num_output_tokens
            right = plain.token_ids[done : done + num_tokens]
            out.append([t + 1 for t in right] if s.request_id == "0" else right)
        return out

    propose = speculator.proposer.propose

    def timed(seqs: list[Sequence], num_tokens: int) -> list[list[int]]:
        propose(seqs, num_tokens)  # the clock's cost
        return drafts(seqs, num_tokens)

    speculator.proposer.propose = timed  # type: ignore[method-assign]
    assert run_all(e, [(prompt, params)])[0][0].token_ids == plain.token_ids
    missed = e.metrics.speculation.verify_steps
    assert e.metrics.speculation.accepted == 0
    e.add_request("1", prompt, params)
    steps = 0
    while e.has_work():
        e.step()
        steps += 1
    # The first stopped after a few verify steps, then tried again now and then; the second
    # speculated nearly every step, getting its 64 tokens in a fraction of the steps.
    assert missed <= 64 // 4
    assert e.metrics.speculation.verify_steps - missed >= steps - 2
    assert steps < 64 // 2
