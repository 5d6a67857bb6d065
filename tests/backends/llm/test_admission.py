"""The engine's admission by the work on its device: with a measured step cost, a request
whose estimated wait (the steps the engine's sequences need, priced at that cost, plus
the other models' outstanding work on the device) is over `max_queue_time_s` is refused at
once and counted, the admitted ones all complete; with no bound none is refused; the cost is
measured from the steps and the published work drains to nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from backends.admission import DeviceWork
from backends.errors import CapacityError
from backends.llm.engine import LLMEngine
from backends.llm.metrics import EngineMetrics
from backends.llm.sampling_params import SamplingParams
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
    engine.work.observe_step(tokens=1, seconds=0.010)  # 10 ms a step
    outcomes = _offer(engine, 8)
    # Two sequences decode together (max_num_seqs 2), 64 prompt tokens fill a step: one or
    # two requests ahead are 3 steps of decodes and 7 or 14 prompt tokens (31 and 32 ms);
    # three are 4.5 steps of decodes and 21 prompt tokens (48 ms), over 40 ms.
    assert outcomes[:3] == [None, None, None]
    refused = outcomes[3:]
    assert all(isinstance(e, CapacityError) and e.retry_after >= 1 for e in refused)
    message = str(refused[0])
    assert "3 sequences, 9 tokens to generate, at most 3 in one, and 21 prompt tokens" in message
    assert "4.8 steps at 10.0 ms measured" in message
    assert "max_queue_time_ms (40)" in message
    assert _shed(registry) == 5
    assert _finish(engine) == {"0", "1", "2"}


def test_other_models_work_on_the_device_counts(llama: Path) -> None:
    engine, _ = _engine(llama, 0.040)
    engine.work.observe_step(tokens=1, seconds=0.010)
    device = DeviceWork("cpu")
    device.register(lambda: 0.020)  # an encoder with 20 ms of passes to run
    engine.work.count_on(device)
    # The first request starts whatever the device holds (nothing of this engine's is
    # outstanding); the second would wait 31 ms of its own and 20 ms of the encoder's.
    outcomes = _offer(engine, 2)
    assert outcomes[0] is None and isinstance(outcomes[1], CapacityError)
    assert "0.02s of other models' work" in str(outcomes[1])
    # The device sees this engine's outstanding work beside the encoder's.
    one_request_s = (MAX_TOKENS + PROMPT / 64) * 0.010
    assert device.outstanding_s() == pytest.approx(0.020 + one_request_s)
    assert _finish(engine) == {"0"}
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
    engine.work.observe_step(tokens=1, seconds=0.010)
    assert _offer(engine, 1) == [None]  # the average request: 7 prompt tokens, 3 to generate
    engine.work.reserve()  # meets one request's work: 31 ms
    engine.work.reserve()  # two: 32 ms
    with pytest.raises(CapacityError) as refused:
        engine.work.reserve()  # three: 48 ms
    assert "3 sequences, 2 being tokenized" in str(refused.value)
    assert engine.work.reserved == 2
    engine.work.unreserve()
    engine.work.unreserve()
    assert engine.work.outstanding().sequences == 1
    assert _finish(engine) == {"0"}


def test_a_step_in_flight_already_slow_reprices_the_work(llama: Path) -> None:
    engine, _ = _engine(llama, 0.040)
    engine.work.observe_step(tokens=1, seconds=0.010)
    assert _offer(engine, 1) == [None]
    # A step has been running 20 ms, twice the average (a burst contends for the device):
    # one request's 3.1 steps ahead cost 62 ms now, not 31.
    engine.work.clock = lambda: 100.0
    engine.work.step_started = 99.980
    with pytest.raises(CapacityError) as refused:
        engine.work.admit(1, PROMPT, MAX_TOKENS)
    assert "3.1 steps at 20.0 ms measured" in str(refused.value)
    # At 1.2 times the average, the average stands.
    engine.work.step_started = 99.988
    engine.work.admit(1, PROMPT, MAX_TOKENS)
