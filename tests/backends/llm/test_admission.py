"""The engine's admission by the work on its device: with a measured step cost, a request
whose estimated wait for its first step (the steps until one of `max_num_seqs` seats is free
and the prompt tokens ahead, priced at that cost, plus the other models' share of the
device) is over `max_queue_time_s`, or whose joining would slow the running batch by more
than that, is refused at once and counted, the admitted ones all complete; a request joins a
running batch without waiting for the others' generations; with no bound none is refused;
the cost is measured from the steps and the published work drains to nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from backends.admission import DeviceWork
from backends.errors import CapacityError
from backends.llm.engine import LLMEngine
from backends.llm.engine_work import EngineWork
from backends.llm.metrics import EngineMetrics
from backends.llm.sampling_params import SamplingParams
from backends.llm.sequence import Sequence, SequenceStatus
from tests.backends.llm.support import build_model, kv_bytes, make_engine, random_prompts

# Each offered request: a 7-token prompt and 3 tokens to generate.
PROMPT, MAX_TOKENS = 7, 3


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("admission"), "llama")


def _engine(folder: Path, max_queue_time_s: float | None) -> tuple[LLMEngine, CollectorRegistry]:
    engine = make_engine(
        folder, kv_cache_bytes=kv_bytes(folder, 64, 16), block_size=16,
        max_num_seqs=2, max_num_batched_tokens=64, max_queue_time_s=max_queue_time_s,
    )  # fmt: skip
    registry = CollectorRegistry()
    engine.metrics = EngineMetrics(registry, "tiny", "1")
    return engine, registry


def _offer(engine: LLMEngine, n: int) -> list[CapacityError | None]:
    """Offer `n` one-sample requests before any step: what each got (None: queued)."""
    outcomes: list[CapacityError | None] = []
    for i, prompt in enumerate(random_prompts(n, seed=3, lengths=(PROMPT, PROMPT))):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        try:
            engine.add_request(str(i), prompt, params)
            outcomes.append(None)
        except CapacityError as e:
            outcomes.append(e)
    return outcomes


def _finish(engine: LLMEngine) -> set[str]:
    finished = set()
    for _ in range(1000):
        if not engine.has_work():
            break
        finished |= {o.request_id for o in engine.step() if o.finished}
    return finished


def _shed(registry: CollectorRegistry) -> float:
    labels = {"model": "tiny", "version": "1", "reason": "queue_time"}
    return registry.get_sample_value("hub_requests_shed_total", labels) or 0.0


def test_requests_beyond_the_queue_time_are_refused_and_the_rest_complete(llama: Path) -> None:
    engine, registry = _engine(llama, 0.040)
    # A step of both seats measured at 10 ms: a smaller batch is priced no higher.
    engine.work.observe_step(tokens=2, seconds=0.010, sequences=2)
    outcomes = _offer(engine, 8)
    # Two sequences decode together (max_num_seqs 2: two seats), 64 prompt tokens fill a
    # step. The second request gets the second seat at once (7 prompt tokens ahead: 1 ms);
    # the third and fourth wait for the first pair's 3 tokens (30 ms, and 14 or 21 prompt
    # tokens: 32 and 33 ms); the fifth for the second pair's too (60 ms), over 40 ms.
    assert outcomes[:4] == [None, None, None, None]
    refused = outcomes[4:]
    assert all(isinstance(e, CapacityError) and e.retry_after >= 1 for e in refused)
    message = str(refused[0])
    assert "an estimated 0.06s of work is ahead of this request" in message
    assert "6.0 steps until one of its 2 seats is free (0 sequences running, 4 waiting)" in message
    assert "28 prompt tokens ahead (0.4 steps), at 10.0 ms a step measured" in message
    assert "max_queue_time_ms (40)" in message
    assert _shed(registry) == 4
    assert _finish(engine) == {"0", "1", "2", "3"}


def test_other_models_work_on_the_device_counts(llama: Path) -> None:
    engine, _ = _engine(llama, 0.040)
    engine.work.observe_step(tokens=2, seconds=0.010, sequences=2)
    device = DeviceWork("cpu")
    device.register(lambda: 0.020)  # an encoder with 20 ms of passes to run
    engine.work.count_on(device)
    # The first request starts whatever the device holds (nothing of this engine's is
    # outstanding); the second takes the free seat behind 7 prompt tokens (1 ms of its own,
    # and the encoder's work up to that: its share meanwhile); the third would wait 32 ms
    # for a seat and prompts and 20 ms of the encoder's, over 40 (alone it fits: above).
    outcomes = _offer(engine, 3)
    assert outcomes[:2] == [None, None] and isinstance(outcomes[2], CapacityError)
    assert "0.02s of other models' work, each counted up to this LLM's" in str(outcomes[2])
    # The device sees this engine's outstanding work beside the encoder's: two requests'
    # 3 tokens each on two seats and their 14 prompt tokens.
    two_requests_s = (MAX_TOKENS + 2 * PROMPT / 64) * 0.010
    assert device.outstanding_s() == pytest.approx(0.020 + two_requests_s)
    assert _finish(engine) == {"0", "1"}
    assert device.outstanding_s() == pytest.approx(0.020)
    engine.work.count_on(None)
    assert len(device) == 1


def test_with_no_bound_every_request_is_queued_and_the_cost_is_measured(llama: Path) -> None:
    engine, registry = _engine(llama, None)
    assert engine.work.step_s is None
    assert _offer(engine, 8) == [None] * 8
    assert _finish(engine) == {str(i) for i in range(8)}
    assert (engine.work.step_s or 0) > 0
    assert not engine.work.published and engine.work.outstanding_s() == 0
    assert _shed(registry) == 0


def test_max_queue_time_is_a_runtime_key_of_llms() -> None:
    from backends.llm.config import EngineConfig

    config = EngineConfig.from_runtime_config({"max_queue_time_ms": 100}, 1 << 30)
    assert config.max_queue_time_s == 0.1
    assert EngineConfig.from_runtime_config({}, 1 << 30).max_queue_time_s is None


def test_an_engine_dropped_without_an_unload_leaves_its_device(llama: Path) -> None:
    import gc

    engine, _ = _engine(llama, None)
    device = DeviceWork("cpu")
    engine.work.count_on(device)
    assert len(device) == 1
    del engine
    gc.collect()
    assert len(device) == 0


def test_requests_being_tokenized_count_as_the_average_request(llama: Path) -> None:
    engine, _ = _engine(llama, 0.040)
    engine.work.observe_step(tokens=2, seconds=0.010, sequences=2)
    assert _offer(engine, 1) == [None]  # the average request: 7 prompt tokens, 3 to generate
    engine.work.reserve()  # meets one request: a seat is free (1 ms)
    engine.work.reserve()  # two: both seats taken, 3 steps (32 ms)
    engine.work.reserve()  # three: 33 ms
    with pytest.raises(CapacityError) as refused:
        engine.work.reserve()  # four: 6 steps (64 ms)
    assert "(0 sequences running, 4 waiting, 3 being tokenized)" in str(refused.value)
    assert engine.work.reserved == 3
    for _ in range(3):
        engine.work.unreserve()
    assert engine.work.outstanding().sequences == 1
    assert _finish(engine) == {"0"}


def test_a_step_in_flight_already_slow_reprices_the_work(llama: Path) -> None:
    engine, _ = _engine(llama, 0.040)
    engine.work.observe_step(tokens=2, seconds=0.010, sequences=2)
    assert _offer(engine, 2) == [None, None]
    # A step has been running 20 ms, twice the average (a burst contends for the device):
    # the 3.2 steps ahead of a third request (a seat, prompts) cost 64 ms now, not 32.
    engine.work.clock = lambda: 100.0
    engine.work.step_started = 99.980
    with pytest.raises(CapacityError) as refused:
        engine.work.admit(1, PROMPT, MAX_TOKENS)
    assert "3.0 steps until one of its 2 seats is free" in str(refused.value)
    assert "at 20.0 ms a step measured" in str(refused.value)
    # At 1.2 times the average, the average stands (and nothing is left of that step).
    engine.work.step_started = 99.988
    engine.work.admit(1, PROMPT, MAX_TOKENS)


def _sequences(n: int, prompt: int, max_tokens: int, generated: int) -> list[Sequence]:
    """`n` sequences of `prompt` tokens and up to `max_tokens`; with `generated` tokens
    they run (their prompts computed), with none they wait."""
    out = []
    for i in range(n):
        seq = Sequence(i, str(i), list(range(3, 3 + prompt)), SamplingParams(),
                       max_tokens=max_tokens, block_size=16)  # fmt: skip
        if generated:
            seq.status = SequenceStatus.RUNNING
            for _ in range(generated):
                seq.append_token(5)
            seq.num_computed_tokens = seq.num_tokens - 1
        out.append(seq)
    return out


def test_a_short_request_joins_a_running_batch_when_a_step_is_short() -> None:
    # Six sequences decode, 60 of their 64 tokens still to come, 2 ms a step: they hold
    # 0.12 s of work, but a new request takes a free seat at the next step.
    work = EngineWork(0.050, max_num_seqs=8, max_num_batched_tokens=64)
    work.observe_step(tokens=6, seconds=0.002, sequences=6)
    work.publish(_sequences(6, prompt=20, max_tokens=64, generated=4))
    assert work.outstanding_s() == pytest.approx(0.120)
    work.admit(1, prompt_tokens=20, max_tokens=8)
    # With every seat taken it waits for the first of them to free: 60 steps, 0.12 s.
    work.publish(_sequences(8, prompt=20, max_tokens=64, generated=4))
    with pytest.raises(CapacityError, match=r"60\.0 steps until one of its 8 seats is free"):
        work.admit(1, prompt_tokens=20, max_tokens=8)


def test_prompt_tokens_ahead_over_the_bound_are_refused() -> None:
    work = EngineWork(0.050, max_num_seqs=8, max_num_batched_tokens=64)
    work.observe_step(tokens=8, seconds=0.010, sequences=8)
    running = _sequences(4, prompt=20, max_tokens=64, generated=4)
    # Two prompts of 100 tokens wait: 200 tokens over the 60 a step leaves after the four
    # decodes, 3.3 steps (33 ms): admitted; three (300 tokens, 50 ms) and a step in flight
    # with 5 ms left: refused.
    work.publish([*running, *_sequences(2, prompt=100, max_tokens=8, generated=0)])
    work.admit(1, prompt_tokens=20, max_tokens=8)
    work.publish([*running, *_sequences(3, prompt=100, max_tokens=8, generated=0)])
    work.clock = lambda: 100.0
    work.step_started = 99.995
    with pytest.raises(CapacityError) as refused:
        work.admit(1, prompt_tokens=20, max_tokens=8)
    message = str(refused.value)
    assert "5.0 ms left of the step running" in message
    assert "300 prompt tokens ahead (5.0 steps)" in message
    assert refused.value.retry_after >= 1


def test_a_batch_larger_than_any_measured_is_priced_in_proportion_until_measured() -> None:
    work = EngineWork(0.050, max_num_seqs=32, max_num_batched_tokens=512)
    work.observe_step(tokens=30, seconds=0.001)  # a sequence alone: 1 ms a step
    # Two run with 15 of 16 tokens left; a third of 16 would make steps of 3, priced at 3 ms
    # (nothing larger measured): its 16 tokens and the batch's 2 ms a step slower, 32 ms.
    work.publish(_sequences(2, prompt=20, max_tokens=16, generated=1))
    work.admit(1, prompt_tokens=20, max_tokens=16)
    # A fifth joining four: steps of 5 at 5 ms, 64 ms slower over 16 tokens: refused,
    # though every seat but four is free and no prompt waits.
    work.publish(_sequences(4, prompt=20, max_tokens=16, generated=1))
    with pytest.raises(CapacityError) as refused:
        work.admit(1, prompt_tokens=20, max_tokens=16)
    message = str(refused.value)
    assert "5 sequences would share each step" in message
    assert "a step 4.0 ms longer than one sequence's alone (at 5.0 ms against 1.0 ms" in message
    assert "its own 16 tokens would take an estimated 0.06s longer than alone" in message
    assert refused.value.retry_after >= 1
    # Once steps of four have been measured at 1.5 ms, five cost 1.9 ms: admitted.
    work.observe_step(tokens=4, seconds=0.0015, sequences=4)
    assert work.step_at(5) == pytest.approx(0.001875)
    work.admit(1, prompt_tokens=20, max_tokens=16)


def test_joining_a_batch_that_it_would_slow_too_much_is_refused() -> None:
    work = EngineWork(0.050, max_num_seqs=8, max_num_batched_tokens=64)
    # A lone step takes 2 ms, one of eight 3 ms: a batch between them is priced at most 3 ms.
    work.observe_step(tokens=1, seconds=0.002)
    work.observe_step(tokens=8, seconds=0.003, sequences=8)
    assert work.step_at(5) == pytest.approx(0.003)
    # Four running with 30 tokens left, a fifth of 32: each of its steps and theirs 1 ms
    # slower than alone, 32 ms over 32 tokens: admitted.
    work.publish(_sequences(4, prompt=20, max_tokens=32, generated=2))
    work.admit(1, prompt_tokens=20, max_tokens=32)
    # Seven running with 60 tokens left, an eighth of 64: 64 ms, refused, though a seat is
    # free.
    work.publish(_sequences(7, prompt=20, max_tokens=64, generated=4))
    with pytest.raises(CapacityError) as refused:
        work.admit(1, prompt_tokens=20, max_tokens=64)
    assert "8 sequences would share each step" in str(refused.value)
    assert "the longest generation (64 tokens) 0.06s" in str(refused.value)
    # A short request still slows the longest generation left (60 tokens, 60 ms): refused.
    with pytest.raises(CapacityError) as refused:
        work.admit(1, prompt_tokens=20, max_tokens=4)
    assert "the longest generation (60 tokens) 0.06s" in str(refused.value)


def test_a_batch_waiting_for_its_first_step_still_saturates_the_model() -> None:
    work = EngineWork(0.050, max_num_seqs=32, max_num_batched_tokens=512)
    work.observe_step(tokens=30, seconds=0.001)
    # Four admitted a moment ago wait for their first step (a burst's start): a fifth of 16
    # tokens would slow them too much, and no seat frees before the first of them has made
    # its 16 tokens, so the model's next requests are refused as long (at the HTTP edge).
    work.publish(_sequences(4, prompt=20, max_tokens=16, generated=0))
    with pytest.raises(CapacityError) as refused:
        work.admit(1, prompt_tokens=20, max_tokens=16)
    assert "5 sequences would share each step" in str(refused.value)
    assert refused.value.saturated_s == pytest.approx(16 * work.step_at(4))
