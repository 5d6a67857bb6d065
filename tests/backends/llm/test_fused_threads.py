"""A fused step runs on all its threads while they are faster and on half while another
process holds a core and stalls them at their barriers, and turns back when the load lifts;
a prompt's step is never spent measuring the slower side; greedy output is the same either
way. The machine is simulated: step times are made up
and handed to the choice, so nothing here depends on the machine's speed or load."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from backends.llm.fused.kernel import fused_kernel
from backends.llm.fused.threads import (
    CONFIRM_STEPS,
    MIN_SAMPLES,
    PROBE_FEWER_EVERY,
    PROBE_MOST_EVERY,
    WINDOW,
    ThreadChoice,
)
from backends.llm.kernel_settings import KernelSettings
from backends.llm.metrics import EngineMetrics
from backends.llm.sampling_params import SamplingParams
from backends.threads import cores
from tests.backends.llm.support import build_model, make_engine, random_prompts, run_all

QUIET = {2: 0.003, 1: 0.005}  # seconds a step takes at 2 threads, at 1


def contended(step: int) -> dict[int, float]:
    """Two threads stall one step in three (a time slice lost at a barrier), and are faster
    than one in the others; one thread does not stall."""
    return {2: 0.2 if step % 3 == 0 else 0.003, 1: 0.005}


def run(choice: ThreadChoice, steps: int, machine: Callable[[int], dict[int, float]]) -> list[int]:
    """Threads each of `steps` one-row steps ran on, on a machine of those step times."""
    chosen = []
    for i in range(steps):
        threads = choice.threads(1, 2)
        choice.observe(1, 2, threads, machine(i)[threads])
        chosen.append(threads)
    return chosen


def test_a_quiet_machine_keeps_every_thread_but_for_probes() -> None:
    choice = ThreadChoice()
    first = run(choice, 2 * MIN_SAMPLES, lambda _: QUIET)
    assert first == [2] * MIN_SAMPLES + [1] * MIN_SAMPLES  # both sides measured first
    later = run(choice, 4 * PROBE_FEWER_EVERY, lambda _: QUIET)
    assert later.count(1) == 4  # one probe of the other side in PROBE_FEWER_EVERY
    # Another step size, or another thread limit, is measured on its own.
    assert choice.threads(8, 2) == 2 and choice.threads(1, 4) == 4
    assert choice.threads(1, 1) == 1  # nothing to choose


def test_a_contended_machine_runs_on_fewer_threads_then_returns_when_it_lifts() -> None:
    choice = ThreadChoice()
    run(choice, 2 * PROBE_FEWER_EVERY, lambda _: QUIET)
    stalled = run(choice, 8 * PROBE_MOST_EVERY, contended)
    # Fewer threads now, but for each probe of all threads and, when the probe came back
    # fast, the steps confirming it until the first stall: one stalled step per probe.
    last = stalled[-4 * PROBE_MOST_EVERY :]
    start = len(stalled) - len(last)
    stalls = sum(t == 2 and (start + i) % 3 == 0 for i, t in enumerate(last))
    assert stalls <= 4 and last.count(2) <= 3 * 4
    lifted = run(choice, (WINDOW + 2) * PROBE_MOST_EVERY, lambda _: QUIET)
    assert lifted[-PROBE_FEWER_EVERY:].count(2) == PROBE_FEWER_EVERY - 1


def test_a_burst_of_stalls_costs_at_most_a_probe_period_on_fewer_threads() -> None:
    # Another process woke for a moment: six steps on all threads ran at three times and
    # a third their time, twice as long as on one thread.
    choice = ThreadChoice()
    run(choice, 2 * PROBE_FEWER_EVERY, lambda _: QUIET)
    burst = run(choice, 6, lambda _: {2: 0.01, 1: 0.005})
    assert burst[-1] == 1  # it turned to fewer threads, as it should while the burst lasted
    after = run(choice, 3 * PROBE_MOST_EVERY, lambda _: QUIET)
    # The first probe of all threads is confirmed at once: all threads again, but for the
    # probes of fewer threads.
    assert after[: PROBE_MOST_EVERY + CONFIRM_STEPS + 1].count(1) <= PROBE_MOST_EVERY
    assert after[PROBE_MOST_EVERY + CONFIRM_STEPS + 1 :].count(1) <= 2


def test_fewer_threads_must_win_by_a_margin() -> None:
    # All threads' steps alternate between fast and slow (another process's short wake-ups),
    # their window's score a few percent over one thread's steady time: within the margin,
    # so all threads stay (a noisy window does not send a quiet machine to one thread).
    choice = ThreadChoice()

    def noisy(step: int) -> dict[int, float]:
        return {2: 0.0032 if step % 2 else 0.0060, 1: 0.0042}

    run(choice, PROBE_FEWER_EVERY, noisy)  # both windows full
    chosen = run(choice, 4 * PROBE_FEWER_EVERY, noisy)
    assert chosen.count(1) <= 4  # the probes only
    # Well past the margin (a contended machine) fewer threads win as before.
    assert run(choice, 2 * PROBE_MOST_EVERY, contended)[-PROBE_MOST_EVERY:].count(1) > (
        PROBE_MOST_EVERY // 2
    )


def test_one_step_the_os_delayed_does_not_decide() -> None:
    choice = ThreadChoice()
    run(choice, 2 * MIN_SAMPLES, lambda _: QUIET)
    choice.observe(1, 2, 2, 1.0)  # one delay of a second on the side that is faster
    assert run(choice, PROBE_FEWER_EVERY - 1, lambda _: QUIET).count(1) <= 1


def prefill(choice: ThreadChoice, rows: int, machine: dict[int, float]) -> int:
    """Threads one prompt step of `rows` rows ran on (it may not probe)."""
    threads = choice.threads(rows, 2, may_probe=False)
    choice.observe(rows, 2, threads, machine[threads])
    return threads


def test_prompt_steps_run_on_every_thread_until_steps_that_may_probe_say_otherwise() -> None:
    choice = ThreadChoice()
    # A fresh engine's prompts, one request after another: nothing measured, all threads.
    assert [prefill(choice, 40, contended(0)) for _ in range(2 * MIN_SAMPLES)] == [2] * 6
    assert choice.summary()["64x2"]["fewer"] is None
    # Its decodes measure both sides and find one thread faster under load ...
    run(choice, 4 * PROBE_MOST_EVERY, contended)
    # ... and prompts of any size follow the nearest measured size, for as long as their
    # own size is not measured on both sides.
    assert [prefill(choice, rows, contended(0)) for rows in (40, 40, 200)] == [1, 1, 1]
    assert choice.steps[1] > 3 * PROBE_MOST_EVERY
    # The load lifts: the decodes' probes turn them back to all threads, and prompts with them.
    run(choice, (WINDOW + 2) * PROBE_MOST_EVERY, lambda _: QUIET)
    assert [prefill(choice, rows, QUIET) for rows in (40, 200, 7)] == [2, 2, 2]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("fused-threads"), "llama")


def test_greedy_output_is_the_same_whichever_count_each_step_runs_on(llama: Path) -> None:
    kernel = fused_kernel(KernelSettings())
    if kernel is None or not kernel.threaded or cores() < 2:
        pytest.skip("no threaded fused kernel or one core: nothing to choose between")
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = random_prompts(3, seed=5, lengths=(4, 20))
    outputs = []
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # this folder's tests run on one otherwise
        for adaptive in (False, True):
            registry = CollectorRegistry()
            engine = make_engine(llama, metrics=EngineMetrics(registry, "m", "1"))
            engine.runner.fused.adaptive = adaptive
            done = run_all(engine, [(p, greedy) for p in prompts])
            outputs.append([r[0].token_ids for r in done])
            steps = engine.runner.fused.thread_choice.steps
            assert sorted(steps) == ([1, 2] if adaptive else [])
            # /metrics says how many steps ran on each count.
            for threads in (1, 2):
                counted = registry.get_sample_value(
                    "hub_llm_fused_steps_total",
                    {"model": "m", "version": "1", "threads": str(threads)},
                )
                assert (counted or 0) == steps[threads]
    finally:
        torch.set_num_threads(before)
    assert outputs[0] == outputs[1]


def test_a_fresh_engines_prompt_steps_run_on_every_thread(llama: Path) -> None:
    kernel = fused_kernel(KernelSettings())
    if kernel is None or not kernel.threaded or cores() < 2:
        pytest.skip("no threaded fused kernel or one core: nothing to choose between")
    first_token = SamplingParams(temperature=0.0, max_tokens=1)  # one prompt step each
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        engine = make_engine(llama)
        for prompt in random_prompts(2 * MIN_SAMPLES, seed=7, lengths=(20, 30)):
            run_all(engine, [(prompt, first_token)])
    finally:
        torch.set_num_threads(before)
    assert engine.runner.fused.thread_choice.steps == {2: 2 * MIN_SAMPLES}
