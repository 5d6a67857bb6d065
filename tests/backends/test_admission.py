"""Admission by queue time: the estimate from measured passes, the refusal's message and
Retry-After, and a burst against a batcher whose forward pass is parked (so the queue's state
at each arrival is known exactly): the requests that fit the bound run, the rest are refused at
once and counted, none is lost."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from backends.admission import QueueTimeAdmission
from backends.batch_limits import BatchLimits
from backends.batch_metrics import BatchMetrics
from backends.batching import DynamicBatcher
from backends.errors import CapacityError
from backends.runtime_config import EmbedderConfig, RuntimeConfigError
from tests.backends.test_batching import Item, UpperModel, submit, wait_entered


def test_nothing_is_refused_before_a_pass_is_measured() -> None:
    admission = QueueTimeAdmission(0.0, name="emb")
    assert admission.estimated_wait(1000) is None
    admission.check(1000, 1)  # no rate known: admitted


def test_the_wait_is_inputs_ahead_times_the_averaged_cost_per_input() -> None:
    admission = QueueTimeAdmission(1.0, name="emb", workers=2, alpha=0.5)
    admission.observe(10, 0.2)  # 20 ms an input on one worker, two workers: 10 ms
    assert admission.estimated_wait(100) == pytest.approx(1.0)
    admission.observe(10, 0.6)  # 60 ms: the average moves halfway, to 40 ms (20 ms queued)
    assert admission.estimated_wait(100) == pytest.approx(2.0)
    admission.observe(0, 5.0)  # an empty pass says nothing
    assert admission.estimated_wait(100) == pytest.approx(2.0)


def test_a_refusal_names_the_queue_and_asks_to_retry_once_it_drained() -> None:
    admission = QueueTimeAdmission(0.5, name="embedder emb v1")
    admission.observe(1, 0.01)
    admission.check(50, 4)  # 0.5 s: at the bound, admitted
    with pytest.raises(CapacityError) as e:
        admission.check(450, 4)  # 4.5 s
    message = str(e.value)
    assert "embedder emb v1 is overloaded" in message and "450 inputs wait ahead" in message
    assert "4.50s" in message and "100 inputs/s" in message and "max_queue_time_ms (500)" in message
    assert e.value.retry_after == 4  # until the queue is back under the bound


def test_without_a_bound_it_only_measures() -> None:
    admission = QueueTimeAdmission(None, name="emb")
    admission.observe(1, 10.0)
    admission.check(10**6, 1)
    assert admission.estimated_wait(3) == pytest.approx(30.0)


def test_max_queue_time_is_a_runtime_key_of_encoders() -> None:
    limits = BatchLimits.from_config(EmbedderConfig.parse({"max_queue_time_ms": 250}))
    assert limits.max_queue_time_s == 0.25
    assert BatchLimits.from_config(EmbedderConfig.parse({})).max_queue_time_s is None
    with pytest.raises(RuntimeConfigError, match="max_queue_time_ms"):
        EmbedderConfig.parse({"max_queue_time_ms": -1})


def _shed(registry: CollectorRegistry, reason: str) -> float:
    labels = {"model": "upper", "version": "1", "reason": reason}
    return registry.get_sample_value("hub_requests_shed_total", labels) or 0.0


async def _burst(max_queue_time_s: float | None, n: int) -> tuple[list[object], CollectorRegistry]:
    """`n` one-input requests arriving while a pass is parked, the cost of an input measured
    at 10 ms: what each request got, in arrival order."""
    model = UpperModel()
    registry = CollectorRegistry()
    limits = BatchLimits(batch_wait_s=0.0, max_batch_size=1, max_queue_time_s=max_queue_time_s)
    b: DynamicBatcher[list[str], Item, str] = DynamicBatcher(
        model,  # type: ignore[arg-type]
        limits,
        name="upper",
        metrics=BatchMetrics(registry, "upper", "1"),
    )
    try:
        model.hold()
        running = asyncio.create_task(submit(b, ["first"]))
        await wait_entered(model)
        b.admission.observe(1, 0.010)
        # Tasks start in creation order, each counted in the queue before the next arrives.
        burst = [asyncio.create_task(submit(b, [f"r{i}"])) for i in range(n)]
        await asyncio.sleep(0)
        shed_at_once = [t.done() for t in burst]
        model.release()
        outcomes: list[object] = list(await asyncio.gather(*burst, return_exceptions=True))
        assert await running == ["FIRST"]
        # A refusal is answered before any pass runs, an admitted request only after.
        assert shed_at_once == [isinstance(o, CapacityError) for o in outcomes]
        return outcomes, registry
    finally:
        model.release()
        b.close()


async def test_a_burst_is_shed_beyond_the_queue_time_and_the_rest_is_served() -> None:
    outcomes, registry = await _burst(0.025, 10)
    # 0, 10 and 20 ms ahead fit 25 ms; from 30 ms on each arrival is refused.
    assert outcomes[:3] == [["R0"], ["R1"], ["R2"]]
    refused = outcomes[3:]
    assert all(isinstance(o, CapacityError) for o in refused)
    assert all(o.retry_after >= 1 for o in refused)  # type: ignore[union-attr]
    assert "3 inputs wait ahead" in str(refused[0])
    assert _shed(registry, "queue_time") == 7 and _shed(registry, "queue_full") == 0


async def test_with_shedding_off_the_same_burst_is_all_served() -> None:
    outcomes, registry = await _burst(None, 10)
    assert outcomes == [[f"R{i}"] for i in range(10)]
    assert _shed(registry, "queue_time") == 0
