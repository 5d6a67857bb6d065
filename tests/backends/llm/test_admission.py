"""The engine's admission by queue time: with a measured cost per sequence, requests beyond
`max_queue_time_s` of waiting sequences are refused at once (and counted), the admitted ones
all complete; with no bound none is refused; the rate is measured from the steps."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from backends.errors import CapacityError
from backends.llm.engine import LLMEngine
from backends.llm.metrics import EngineMetrics
from backends.llm.sampling_params import SamplingParams
from tests.backends.llm.support import build_model, kv_bytes, make_engine, random_prompts


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
    for i, prompt in enumerate(random_prompts(n, seed=3, lengths=(4, 8))):
        try:
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=3, temperature=0.0))
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
    engine, registry = _engine(llama, 0.25)
    engine.admission.observe(1, 0.1)  # a sequence leaves the queue every 100 ms
    outcomes = _offer(engine, 8)
    # 0, 100 and 200 ms of sequences ahead fit 250 ms; 300 ms does not.
    assert outcomes[:3] == [None, None, None]
    refused = outcomes[3:]
    assert all(isinstance(e, CapacityError) and e.retry_after >= 1 for e in refused)
    assert "3 sequences wait ahead" in str(refused[0]) and "max_queue_time_ms (250)" in str(
        refused[0]
    )
    assert _shed(registry) == 5
    assert _finish(engine) == {"0", "1", "2"}


def test_with_no_bound_every_request_is_queued_and_the_rate_is_measured(llama: Path) -> None:
    engine, registry = _engine(llama, None)
    assert engine.admission.seconds_per_input is None
    assert _offer(engine, 8) == [None] * 8
    assert _finish(engine) == {str(i) for i in range(8)}
    # Sequences waited behind the two running ones: their rate of leaving was measured.
    assert (engine.admission.seconds_per_input or 0) > 0
    assert _shed(registry) == 0


def test_max_queue_time_is_a_runtime_key_of_llms() -> None:
    from backends.llm.config import EngineConfig

    config = EngineConfig.from_runtime_config({"max_queue_time_ms": 100}, 1 << 30)
    assert config.max_queue_time_s == 0.1
    assert EngineConfig.from_runtime_config({}, 1 << 30).max_queue_time_s is None
