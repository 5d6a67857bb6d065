"""Admission by queue time: the estimate from measured passes, the refusal's message and
Retry-After, and a burst against a batcher whose forward pass is parked (so the queue's state
at each arrival is known exactly): the requests that fit the bound run, the rest are refused at
once and counted, none is lost."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from backends.admission import DeviceWork, QueueTimeAdmission, device_work
from backends.encoders.batch_limits import BatchLimits
from backends.encoders.batch_metrics import BatchMetrics
from backends.encoders.batching import DynamicBatcher
from backends.errors import CapacityError
from backends.runtime_config import EmbedderConfig, RuntimeConfigError
from tests.backends.encoders.test_batching import Item, UpperModel, submit, wait_entered


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


class Clock:
    """A clock the test moves: how long the pass in flight has run."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _burst(
    max_queue_time_s: float | None,
    n: int,
    *,
    ran_s: float = 0.010,
    device: DeviceWork | None = None,
) -> tuple[list[object], CollectorRegistry]:
    """`n` one-input requests arriving while a pass of one input is parked after running
    `ran_s` (by default its measured cost, 10 ms: nothing left of it), the cost of an input
    measured at 10 ms: what each request got, in arrival order."""
    model = UpperModel()
    registry = CollectorRegistry()
    limits = BatchLimits(batch_wait_s=0.0, max_batch_size=1, max_queue_time_s=max_queue_time_s)
    clock = Clock()
    b: DynamicBatcher[list[str], Item, str] = DynamicBatcher(
        model,  # type: ignore[arg-type]
        limits,
        name="upper",
        metrics=BatchMetrics(registry, "upper", "1"),
        device_work=device,
        clock=clock,
    )
    try:
        model.hold()
        running = asyncio.create_task(submit(b, ["first"]))
        await wait_entered(model)
        b.admission.observe(1, 0.010)
        clock.now += ran_s
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


async def test_what_is_left_of_the_pass_in_flight_counts_as_queued() -> None:
    # The pass in flight has run 4 ms of its 10: 6 ms left, then 10 ms for each input ahead.
    outcomes, _ = await _burst(0.025, 10, ran_s=0.004)
    # 6 and 16 ms fit 25 ms; 26 ms does not.
    assert outcomes[:2] == [["R0"], ["R1"]]
    assert all(isinstance(o, CapacityError) for o in outcomes[2:])
    message = str(outcomes[2])
    assert "0.01s left of passes running" in message and "0.02s queued" in message


async def test_a_pass_slower_than_the_average_raises_the_cost_at_once() -> None:
    # The pass in flight has taken 30 ms for its one input (measured average: 10 ms): the
    # device is contended now, so a queued input is estimated at 30 ms, before that pass ends.
    outcomes, _ = await _burst(0.025, 10, ran_s=0.030)
    assert outcomes[0] == ["R0"]  # nothing queued, nothing left of the pass: admitted
    assert all(isinstance(o, CapacityError) for o in outcomes[1:])
    assert "at the measured 33 inputs/s" in str(outcomes[1])


async def test_other_models_work_on_the_device_counts() -> None:
    device = DeviceWork("cpu")
    other = device.register(lambda: 0.012)  # another model has 12 ms outstanding
    outcomes, _ = await _burst(0.025, 10, device=device)
    # 0 and 10 ms queued here, with the other's 12 ms counted up to them (0 and 10 ms), fit
    # 25 ms; 20 ms and its 12 do not.
    assert outcomes[:2] == [["R0"], ["R1"]]
    assert all(isinstance(o, CapacityError) for o in outcomes[2:])
    assert "0.01s of other models' work on its device" in str(outcomes[2])
    device.unregister(other)
    outcomes, _ = await _burst(0.025, 10, device=device)
    assert sum(not isinstance(o, CapacityError) for o in outcomes) == 3


def test_a_model_with_nothing_queued_or_running_is_always_admitted() -> None:
    admission = QueueTimeAdmission(0.025, name="emb")
    admission.observe(1, 0.010)
    admission.check(0, 1, elsewhere_s=10.0)  # other models' backlog does not starve it
    with pytest.raises(CapacityError):
        admission.check(1, 1, elsewhere_s=10.0)
    with pytest.raises(CapacityError):
        admission.check(0, 1, running_s=0.001, elsewhere_s=10.0)


async def test_batchers_on_one_device_see_each_others_queue() -> None:
    """Two models on one device: while one holds queued work, the other's admission counts
    its share (its work up to the other's own: they run side by side); once the first's
    work is done it counts nothing, and a closed batcher leaves."""
    device = DeviceWork("cpu")
    limits = BatchLimits(batch_wait_s=0.0, max_batch_size=1, max_queue_time_s=0.025)
    first, second = UpperModel(), UpperModel()
    clock = Clock()  # frozen: a pass in flight has all of its 10 ms left
    a, b = (
        DynamicBatcher[list[str], Item, str](
            model,  # type: ignore[arg-type]
            limits,
            name=name,
            device_work=device,
            clock=clock,
        )
        for model, name in ((first, "a"), (second, "b"))
    )
    try:
        a.admission.observe(1, 0.010)
        assert device.outstanding_s() == 0.0
        first.hold()
        parked = asyncio.create_task(submit(a, ["one"]))
        await wait_entered(first)
        queued = [asyncio.create_task(submit(a, [f"q{i}"])) for i in range(2)]
        await asyncio.sleep(0)
        assert a.queued == 2
        # a: 2 queued x 10 ms, plus the 10 ms of the pass in flight.
        assert device.outstanding_s() == pytest.approx(0.030)
        assert a.outstanding_s() == pytest.approx(0.030)
        clock.now += 0.004
        assert a.outstanding_s() == pytest.approx(0.026)
        b.admission.observe(1, 0.010)
        second.hold()
        b_first = asyncio.create_task(submit(b, ["b0"]))
        await wait_entered(second)
        # b's own 10 ms and a's share meanwhile (its 26 ms counted up to b's 10): 20 ms.
        b_next = asyncio.create_task(submit(b, ["b1"]))
        await asyncio.sleep(0)
        assert not b_next.done()
        # Behind b's 20 ms, a's share is 20 ms of its 26: 40 ms, refused.
        b_last = asyncio.create_task(submit(b, ["b2"]))
        await asyncio.sleep(0)
        assert b_last.done() and isinstance(b_last.exception(), CapacityError)
        assert "0.02s of other models' work on its device" in str(b_last.exception())
        first.release()
        second.release()
        assert await parked == ["ONE"] and await asyncio.gather(*queued) == [["Q0"], ["Q1"]]
        assert await b_first == ["B0"] and await b_next == ["B1"]
        assert a.outstanding_s() == 0.0
    finally:
        first.release()
        second.release()
        a.close()
        b.close()
    assert len(device) == 0  # closed batchers left the device


def test_other_models_count_up_to_this_models_own_work() -> None:
    device = DeviceWork("cpu")
    device.register(lambda: 0.500)  # a long backlog: it shares the device meanwhile
    device.register(lambda: 0.004)
    mine = device.register(lambda: 0.300)
    assert device.outstanding_s(excluding=mine) == pytest.approx(0.504)
    assert device.outstanding_s(excluding=mine, within=0.010) == pytest.approx(0.014)


def test_device_work_is_one_per_device() -> None:
    assert device_work("cpu") is device_work("cpu:0")
    assert device_work("cuda:0") is not device_work("cuda:1")


async def test_with_shedding_off_the_same_burst_is_all_served() -> None:
    outcomes, registry = await _burst(None, 10)
    assert outcomes == [[f"R{i}"] for i in range(10)]
    assert _shed(registry, "queue_time") == 0


def test_a_contended_device_is_counted_once() -> None:
    admission = QueueTimeAdmission(0.035, name="emb")
    admission.observe(1, 0.010)
    # One input ahead: 30 ms at the slowed cost now, or 10 ms at the average plus 20 ms of
    # the other models' work (which is what slowed it): 30 ms either way, not 50.
    admission.check(1, 1, elsewhere_s=0.020, pass_input_s=0.030, slow_running_s=0.0)
    with pytest.raises(CapacityError, match=r"an estimated 0\.05s .*0\.04s of other models"):
        admission.check(1, 1, elsewhere_s=0.040, pass_input_s=0.030, slow_running_s=0.0)


async def test_a_pass_only_a_little_slower_does_not_reprice_the_queue() -> None:
    # 12 ms for an input measured at 10 ms (under SLOW_PASS): the average still holds, so
    # 0 and 10 ms queued fit 25 ms as when the pass took exactly its cost.
    outcomes, _ = await _burst(0.025, 10, ran_s=0.012)
    assert sum(not isinstance(o, CapacityError) for o in outcomes) == 3


async def test_with_a_forward_worker_idle_an_empty_queue_admits_at_once() -> None:
    model = UpperModel()
    limits = BatchLimits(
        batch_wait_s=0.0, max_batch_size=1, max_queue_time_s=0.025, forward_workers=2
    )
    b: DynamicBatcher[list[str], Item, str] = DynamicBatcher(
        model,  # type: ignore[arg-type]
        limits,
        name="upper",
        clock=Clock(),
    )
    try:
        model.hold()
        first = asyncio.create_task(submit(b, ["first"]))
        await wait_entered(model)
        b.admission.observe(1, 0.400)  # the pass in flight has 200 ms left per worker
        second = asyncio.create_task(submit(b, ["second"]))
        await asyncio.sleep(0)
        assert not second.done()  # admitted: the other worker is free
        model.release()
        assert await first == ["FIRST"] and await second == ["SECOND"]
    finally:
        model.release()
        b.close()
