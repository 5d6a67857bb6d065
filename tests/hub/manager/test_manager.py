"""The manager under memory pressure, with fake models that really hold memory: single-flight
loads, waiting limits, eviction within budget, in-flight protection, pins, failures."""

from __future__ import annotations

import asyncio
import gc
import logging
import weakref

import pytest

from hub.errors import Conflict, Unavailable
from hub.manager import ModelKey, ModelState
from tests.hub.manager.conftest import MakeManager, MiB
from tests.support.fake_models import FakeBackend
from tests.support.residency import budget_watch, settled, state


async def test_one_load_however_many_requests_wait(make_manager: MakeManager) -> None:
    manager, loader = make_manager({"a": {"bytes": MiB, "load_seconds": 0.2}})

    async def use() -> int:
        async with manager.acquire("a", 1) as backend:
            return id(backend)

    ids = await asyncio.gather(*(use() for _ in range(20)))
    assert len(set(ids)) == 1
    assert loader.loads == {ModelKey("a", 1): 1}


async def test_waiting_limit_answers_503_with_retry_after(make_manager: MakeManager) -> None:
    manager, _ = make_manager({"a": {"bytes": MiB, "load_seconds": 0.3}}, max_waiting_per_model=2)

    async def use() -> None:
        async with manager.acquire("a", 1):
            pass

    results = await asyncio.gather(*(use() for _ in range(3)), return_exceptions=True)
    refused = [r for r in results if isinstance(r, Unavailable)]
    assert len(refused) == 1 and refused[0].code == "too_many_waiting"
    assert refused[0].headers["Retry-After"] == "1"
    assert "2 requests already wait" in refused[0].message


async def test_interleaved_requests_evict_and_stay_within_budget(make_manager: MakeManager) -> None:
    # Three 40 MiB models, room for two; the host tier holds one parked model.
    manager, loader = make_manager({"a": 40, "b": 40, "c": 40}, budget_mib=100, host_mib=50)
    outputs: dict[str, float] = {}
    async with budget_watch(manager) as checks:
        for name in "abcabcacbbca":
            async with manager.acquire(name, 1) as backend:
                assert isinstance(backend, FakeBackend)
                value = backend.run()
            assert outputs.setdefault(name, value) == value  # same weights after a restore

        # Concurrent requests to all three at once still fit, one after another.
        async def use(name: str) -> float:
            async with manager.acquire(name, 1) as backend:
                await asyncio.sleep(0.01)
                return backend.run()  # type: ignore[attr-defined, no-any-return]

        values = await asyncio.gather(*(use(n) for n in "abcabc"))
        assert values == [outputs[n] for n in "abcabc"]
        await settled(manager)
    assert checks[0] > 0  # the watch saw loads and evictions under way
    evictions = manager.metrics.evictions.collect()[0].samples
    assert sum(s.value for s in evictions if s.labels.get("reason") == "pressure") >= 5
    warm = [
        s for s in manager.metrics.loads.collect()[0].samples if s.labels.get("source") == "warm"
    ]
    assert sum(s.value for s in warm if s.name.endswith("_total")) >= 1  # restored from host
    assert sum(loader.loads.values()) < 15  # the warm tier spared some disk loads


async def test_model_in_flight_is_never_evicted(make_manager: MakeManager) -> None:
    manager, _ = make_manager({"a": 60, "b": 60}, budget_mib=100, load_timeout=0.5)
    async with manager.acquire("a", 1):
        with pytest.raises(Unavailable) as e:
            async with manager.acquire("b", 1):
                pass
        assert state(manager, "a") is ModelState.LOADED
    assert e.value.status_code == 503 and e.value.headers["Retry-After"] == "1"
    message = e.value.message
    assert "b@1" in message and "a@1 (60.0 MiB, 1 request in flight)" in message
    assert "on cpu: needs 60.0 MiB, 40.0 MiB free of 100.0 MiB" in message
    # Once a's request is done, b evicts it.
    async with manager.acquire("b", 1):
        assert state(manager, "a") in (ModelState.UNLOADED, ModelState.WARM)


async def test_waiting_request_gets_room_when_the_holder_finishes(
    make_manager: MakeManager,
) -> None:
    manager, _ = make_manager({"a": 60, "b": 60}, budget_mib=100, load_timeout=30)
    released = asyncio.Event()

    async def hold_a() -> None:
        async with manager.acquire("a", 1):
            await released.wait()

    holder = asyncio.create_task(hold_a())
    await asyncio.sleep(0.05)
    waiter = asyncio.create_task(manager.load("b", 1))
    await asyncio.sleep(0.1)
    assert not waiter.done()  # b waits: a is in flight
    assert state(manager, "b") is ModelState.LOADING
    released.set()
    status = await waiter
    await holder
    assert status.state == "loaded" and state(manager, "a") is not ModelState.LOADED


async def test_pinned_model_survives_pressure(make_manager: MakeManager) -> None:
    manager, loader = make_manager({"a": 30, "b": 30, "c": 30, "d": 30}, budget_mib=100)
    await manager.pin("a", 1)
    async with budget_watch(manager):
        for name in "bcdbcdbdc":
            async with manager.acquire(name, 1):
                pass
            assert state(manager, "a") is ModelState.LOADED
    assert loader.loads[ModelKey("a", 1)] == 1
    [status] = [s for s in manager.status() if s.name == "a"]
    assert status.pinned and status.keep_alive_expires_in_s is None


async def test_a_pin_that_cannot_fit_is_refused_with_the_reason(make_manager: MakeManager) -> None:
    manager, _ = make_manager({"a": 40, "b": 40, "c": 40}, budget_mib=100)
    await manager.pin("a", 1)
    await manager.pin("b", 1)
    with pytest.raises(Conflict) as e:
        await manager.pin("c", 1)
    assert e.value.status_code == 409
    assert "pinned models leave too little room" in e.value.message
    assert "a@1 (40.0 MiB, pinned)" in e.value.message
    # A request for c is refused at once with the same reason, not after the load timeout.
    with pytest.raises(Unavailable) as refused:
        async with manager.acquire("c", 1):
            pass
    assert refused.value.code == "pinned_full"
    await manager.unpin("b", 1)
    async with manager.acquire("c", 1):
        assert state(manager, "b") is not ModelState.LOADED


async def test_too_large_for_any_device_fails_fast(make_manager: MakeManager) -> None:
    manager, _ = make_manager({"huge": 200}, budget_mib=100, load_timeout=60)
    with pytest.raises(Unavailable) as e:
        await manager.load("huge", 1)
    assert e.value.code == "too_large" and "more than the whole budget" in e.value.message


async def test_failed_load_backs_off_and_others_keep_serving(make_manager: MakeManager) -> None:
    manager, loader = make_manager({"bad": {"bytes": MiB, "fail": True}, "good": 1})
    with pytest.raises(Unavailable) as first:
        await manager.load("bad", 1)
    assert first.value.code == "load_failed" and "broken on purpose" in first.value.message
    with pytest.raises(Unavailable) as second:
        async with manager.acquire("bad", 1):
            pass
    assert "next attempt in" in second.value.message and "broken on purpose" in second.value.message
    assert loader.loads[ModelKey("bad", 1)] == 1  # the backoff spared a second attempt
    [bad] = [s for s in manager.status() if s.name == "bad"]
    assert bad.state == "failed" and "broken on purpose" in (bad.error or "")
    async with manager.acquire("good", 1) as backend:
        assert isinstance(backend, FakeBackend)
    assert manager.ledger.used("cpu") == MiB


async def test_larger_than_predicted_is_charged_what_it_measured(
    make_manager: MakeManager, caplog: pytest.LogCaptureFixture
) -> None:
    manager, _ = make_manager({"a": {"bytes": 40 * MiB, "predict": 10 * MiB}})
    with caplog.at_level(logging.WARNING):
        status = await manager.load("a", 1)
    assert status.predicted_bytes == 10 * MiB and status.measured_bytes == 40 * MiB
    assert manager.ledger.used("cpu") == 40 * MiB
    assert "predicted 10.0 MiB, measured 40.0 MiB (+300%)" in caplog.text


async def test_minimum_residency_delays_eviction(make_manager: MakeManager) -> None:
    manager, _ = make_manager({"a": 60, "b": 60}, budget_mib=100, min_residency=0.3)
    await manager.load("a", 1)
    loading = asyncio.create_task(manager.load("b", 1))
    await asyncio.sleep(0.05)
    assert state(manager, "a") is ModelState.LOADED and not loading.done()
    assert (await loading).state == "loaded"


async def test_admin_unload_waits_for_requests_and_frees_the_model(
    make_manager: MakeManager,
) -> None:
    manager, loader = make_manager({"a": 10}, host_mib=100)
    started, finished = asyncio.Event(), asyncio.Event()

    async def request() -> None:
        async with manager.acquire("a", 1):
            started.set()
            await asyncio.sleep(0.1)
            finished.set()

    task = asyncio.create_task(request())
    await started.wait()
    [backend] = loader.backends
    module = weakref.ref(backend.module)  # type: ignore[arg-type]
    status = await manager.unload("a", 1)
    assert finished.is_set() and status.state == "unloaded"  # it waited for the request
    await task
    del backend
    loader.backends.clear()
    gc.collect()
    assert module() is None
    assert manager.ledger.used("cpu") == 0 and manager.host_tier.used_bytes == 0


async def test_unknown_device_in_the_runtime_config_fails_with_the_reason(
    make_manager: MakeManager,
) -> None:
    manager, _ = make_manager({"a": {"bytes": MiB, "device": "cuda:7"}})
    with pytest.raises(Unavailable) as e:
        await manager.load("a", 1)
    assert "cuda:7" in e.value.message and "not configured" in e.value.message


async def test_a_footprint_sized_by_the_device_budget_is_predicted_for_that_device(
    make_manager: MakeManager,
) -> None:
    manager, _ = make_manager({"a": {"bytes": 10 * MiB, "cache_fraction": 0.25}}, budget_mib=80)
    status = await manager.load("a", 1)
    assert status.predicted_bytes == 30 * MiB  # 10 MiB of weights + a quarter of 80 MiB
    assert status.measured_bytes == 30 * MiB and manager.ledger.used("cpu") == 30 * MiB
