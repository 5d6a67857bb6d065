"""Keep-alive with Ollama's meaning, and the host tier: parked weights come back by a copy,
unchanged, and the tier drops its least recently used models beyond its budget."""

from __future__ import annotations

import asyncio
import logging

import pytest

from hub.manager import ModelKey, ModelState
from tests.hub.manager.conftest import MakeManager, MiB
from tests.support.fake_models import FakeBackend
from tests.support.residency import settled, state


async def eventually(condition: object, what: str) -> None:
    """Wait (generously) for `condition()` to hold; fails naming `what`."""
    for _ in range(400):
        if condition():  # type: ignore[operator]
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"never happened: {what}")


async def test_keep_alive_zero_unloads_right_after_the_request(make_manager: MakeManager) -> None:
    manager, _ = make_manager({"a": 10}, host_mib=100)
    async with manager.acquire("a", 1, keep_alive=0):
        assert state(manager, "a") is ModelState.LOADED
    await settled(manager)
    assert state(manager, "a") is ModelState.WARM  # off the device, parked in host memory
    assert manager.ledger.used("cpu") == 0 and manager.host_tier.used_bytes == 10 * MiB


async def test_keep_alive_forever_keeps_it_and_a_duration_expires(
    make_manager: MakeManager,
) -> None:
    manager, _ = make_manager({"a": 10, "b": 10}, keep_alive=0.2)
    async with manager.acquire("a", 1, keep_alive=-1):
        pass
    async with manager.acquire("b", 1):  # the manager's default: 0.2 s
        pass
    [a] = [s for s in manager.status() if s.name == "a"]
    assert a.keep_alive_s == -1 and a.keep_alive_expires_in_s is None
    await eventually(lambda: state(manager, "b") is not ModelState.LOADED, "b expired")
    assert state(manager, "a") is ModelState.LOADED
    # A later request without keep_alive puts the model back on its default (Ollama).
    async with manager.acquire("a", 1):
        pass
    await eventually(lambda: state(manager, "a") is not ModelState.LOADED, "a expired")


async def test_keep_alive_from_the_runtime_config_and_the_request_overrides_it(
    make_manager: MakeManager,
) -> None:
    manager, _ = make_manager({"a": {"bytes": MiB, "keep_alive": "0"}}, keep_alive=300)
    async with manager.acquire("a", 1, keep_alive=300):
        pass
    assert state(manager, "a") is ModelState.LOADED  # the request's 300 s won
    async with manager.acquire("a", 1):
        pass
    await settled(manager)
    assert state(manager, "a") is ModelState.UNLOADED  # the version's own keep_alive: 0


async def test_warm_restore_is_a_copy_and_gives_the_same_outputs(make_manager: MakeManager) -> None:
    manager, loader = make_manager({"a": 40, "b": 40}, budget_mib=50, host_mib=100)
    async with manager.acquire("a", 1) as backend:
        assert isinstance(backend, FakeBackend)
        before = backend.run()
    async with manager.acquire("b", 1):
        pass
    assert state(manager, "a") is ModelState.WARM
    [a] = [s for s in manager.status() if s.name == "a"]
    assert a.host_bytes == 40 * MiB and a.device is None and a.last_device == "cpu"
    async with manager.acquire("a", 1) as backend:
        assert isinstance(backend, FakeBackend)
        assert backend.run() == before
    assert loader.loads[ModelKey("a", 1)] == 1  # restored, not loaded again
    [a] = [s for s in manager.status() if s.name == "a"]
    assert a.warm_load_s is not None and a.cold_load_s is not None
    loads = manager.metrics.loads.labels("a", "1", "ok", "warm")._value.get()
    assert loads == 1


async def test_host_tier_drops_its_least_recently_used_beyond_its_budget(
    make_manager: MakeManager,
) -> None:
    # The device holds one model, the host tier two.
    manager, loader = make_manager({"a": 30, "b": 30, "c": 30}, budget_mib=40, host_mib=70)

    async def use(name: str) -> list[ModelState]:
        async with manager.acquire(name, 1):
            pass
        await settled(manager)
        assert manager.host_tier.used_bytes <= 70 * MiB
        return [state(manager, n) for n in "abc"]

    loaded, warm, unloaded = ModelState.LOADED, ModelState.WARM, ModelState.UNLOADED
    assert await use("a") == [loaded, unloaded, unloaded]
    assert await use("b") == [warm, loaded, unloaded]
    assert await use("c") == [warm, warm, loaded]
    # Restoring a holds its parked copy until it is back; parking c then needs room, so the
    # tier drops its least recently used other model, b.
    assert await use("a") == [loaded, unloaded, warm]
    assert await use("b") == [warm, loaded, warm]
    assert loader.loads == {ModelKey("a", 1): 1, ModelKey("b", 1): 2, ModelKey("c", 1): 1}
    dropped = manager.metrics.evictions.labels("b", "1", "host_tier")._value.get()
    assert dropped == 1


async def test_a_model_being_parked_is_not_dropped_by_a_concurrent_park(
    make_manager: MakeManager, caplog: pytest.LogCaptureFixture
) -> None:
    slow = {"bytes": 40 * MiB, "offload_seconds": 0.3}
    manager, _ = make_manager({"a": slow, "b": slow, "c": 40, "d": 40}, budget_mib=100, host_mib=50)
    for name in "ab":
        async with manager.acquire(name, 1):
            pass
    # c evicts a, whose weights are on their way into the tier (room for one model) while d
    # evicts b: b must not take a's place by dropping a half-parked model.
    await asyncio.gather(manager.load("c", 1), manager.load("d", 1))
    await settled(manager)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    parked = {s.name for s in manager.status() if s.state == "warm"}
    assert len(parked) == 1 and manager.host_tier.used_bytes == 40 * MiB
