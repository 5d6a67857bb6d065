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


def test_both_sides_are_measured_then_the_cheaper_one_is_taken() -> None:
    cost = SpeculationCost()
    choices = []
    for _ in range(2 * MIN_SAMPLES):
        choices.append(cost.speculate(1))
        drafts = choices[-1]
        # With drafts: 3 tokens for 2 s; without: 1 token for 1 s.
        cost.observe(1, drafts, 2.0 if drafts else 1.0, 3 if drafts else 1)
    assert choices == [False] * MIN_SAMPLES + [True] * MIN_SAMPLES
    assert cost.pays(1) is True
    later = [cost.speculate(1) for _ in range(2 * PROBE_EVERY)]
    assert later.count(False) == 2  # a probe of the plain side now and then
    # Another batch size is measured on its own.
    assert cost.pays(16) is None and cost.speculate(16) is False


def test_drafts_that_cost_more_per_token_are_turned_down_and_outliers_do_not_decide() -> None:
    cost = SpeculationCost()
    for _ in range(MIN_SAMPLES):
        cost.observe(4, False, 1.0, 4)
        cost.observe(4, True, 3.0, 8)  # 0.375 s a token against 0.25
    cost.observe(4, False, 1000.0, 4)  # one step the OS delayed
    assert cost.pays(4) is False
    later = [cost.speculate(4) for _ in range(PROBE_EVERY)]
    assert later.count(True) == 1  # a probe of the speculative side


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
    assert cheap.speculator is not None and cheap.speculator.cost.pays(1) is True
    assert slow.speculator is not None and slow.speculator.cost.pays(1) is False
    # The slow proposer only drafts to be measured: its first steps, then a probe now and then.
    assert slow_steps <= MIN_SAMPLES + 96 // PROBE_EVERY + 1 < cheap_steps
