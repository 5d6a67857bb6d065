"""The engine's admission by the work on its device: with a measured step cost, a request
whose estimated wait (the tokens the engine's sequences have left, priced at that cost, plus
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

# Each offered request: a 7-token prompt and 3 tokens to generate, 10 tokens of work.
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
    engine, registry = _engine(llama, 0.025)
    engine.work.observe_step(tokens=10, seconds=0.010)  # 1 ms a token
    outcomes = _offer(engine, 8)
    # 0, 10 and 20 ms of tokens ahead fit 25 ms; 30 ms does not.
    assert outcomes[:3] == [None, None, None]
    refused = outcomes[3:]
    assert all(isinstance(e, CapacityError) and e.retry_after >= 1 for e in refused)
    message = str(refused[0])
    assert "30 tokens left" in message and "max_queue_time_ms (25)" in message
    assert _shed(registry) == 5
    assert _finish(engine) == {"0", "1", "2"}


def test_other_models_work_on_the_device_counts(llama: Path) -> None:
    engine, _ = _engine(llama, 0.025)
    engine.work.observe_step(tokens=10, seconds=0.010)
    device = DeviceWork("cpu")
    device.register(lambda: 0.020)  # an encoder with 20 ms of passes to run
    engine.work.count_on(device)
    # The first request starts whatever the device holds (nothing of this engine's is
    # outstanding); the second would wait 10 ms of its own and 20 ms of the encoder's.
    outcomes = _offer(engine, 2)
    assert outcomes[0] is None and isinstance(outcomes[1], CapacityError)
    assert "0.02s of other models' work" in str(outcomes[1])
    # The device sees this engine's outstanding work beside the encoder's.
    assert device.outstanding_s() == pytest.approx(0.020 + (PROMPT + MAX_TOKENS) * 0.001)
    assert _finish(engine) == {"0"}
    assert device.outstanding_s() == pytest.approx(0.020)
    engine.work.count_on(None)
    assert len(device) == 1


def test_with_no_bound_every_request_is_queued_and_the_cost_is_measured(llama: Path) -> None:
    engine, registry = _engine(llama, None)
    assert engine.work.seconds_per_token is None
    assert _offer(engine, 8) == [None] * 8
    assert _finish(engine) == {str(i) for i in range(8)}
    assert (engine.work.seconds_per_token or 0) > 0
    assert engine.work.tokens == 0 and engine.work.outstanding_s() == 0
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


def test_requests_being_tokenized_count_at_the_average_request(llama: Path) -> None:
    engine, _ = _engine(llama, 0.025)
    engine.work.observe_step(tokens=10, seconds=0.010)
    assert _offer(engine, 1) == [None]  # 10 tokens of work; the average request's too
    engine.work.reserve()  # meets 10 ms of work
    engine.work.reserve()  # meets 20 ms
    with pytest.raises(CapacityError) as refused:
        engine.work.reserve()  # would meet 30 ms
    assert "(2 requests being tokenized among them)" in str(refused.value)
    assert engine.work.reserved == 2
    engine.work.unreserve()
    engine.work.unreserve()
    assert engine.work.outstanding_tokens() == PROMPT + MAX_TOKENS
    assert _finish(engine) == {"0"}
