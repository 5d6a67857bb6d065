"""LoRA adapters as manager entries that depend on their base: the base is brought up once
for any number of adapters, stays while an adapter serves, leaves only after its adapters,
and parks them with it in the host tier."""

from __future__ import annotations

import asyncio

import pytest

from hub.errors import Unavailable
from hub.manager import ModelKey, ModelState
from tests.hub.manager.conftest import MakeManager, MiB
from tests.support.fake_models import FakeAdapter
from tests.support.residency import budget_watch, settled, state

BASE = ModelKey("base", 1)
MODELS = {
    "base": 60,
    "a1": {"bytes": 5 * MiB, "base": "base"},
    "a2": {"bytes": 5 * MiB, "base": "base"},
    "other": 35,
}


async def output(manager: object, name: str) -> float:
    async with manager.acquire(name, 1) as backend:  # type: ignore[attr-defined]
        assert isinstance(backend, FakeAdapter)
        return backend.run()


async def test_adapters_share_one_base_load_and_are_charged_on_its_device(
    make_manager: MakeManager,
) -> None:
    manager, loader = make_manager(MODELS, budget_mib=100)
    async with budget_watch(manager):
        a1, a2 = await asyncio.gather(output(manager, "a1"), output(manager, "a2"))
    assert a1 != a2  # each adapter answers with its own output
    assert loader.loads == {BASE: 1}  # the base was loaded once, for both
    assert loader.attaches == {ModelKey("a1", 1): 1, ModelKey("a2", 1): 1}
    rows = {s.name: s for s in manager.status()}
    assert rows["a1"].base == "base@1" and rows["a1"].device == "cpu"
    assert rows["base"].adapters == ("a1@1", "a2@1")
    assert manager.ledger.used("cpu") == 70 * MiB


async def test_an_adapter_is_charged_what_it_takes_in_its_bases_dtype(
    make_manager: MakeManager,
) -> None:
    # Predicted from its file (float32, as PEFT saves it), held in the base's dtype (bf16):
    # the charge is what the engine holds, not the file's figure, cold and after a restore.
    fp32_file = {"bytes": 5 * MiB, "predict": 10 * MiB, "base": "base"}
    models = {**MODELS, "a1": fp32_file, "other": 38}
    manager, _ = make_manager(models, budget_mib=100, host_mib=100)
    await output(manager, "a1")
    assert manager.ledger.used("cpu") == 65 * MiB
    async with manager.acquire("other", 1):  # 38 MiB: a1 parks to make room
        pass
    await settled(manager)
    assert state(manager, "a1") is ModelState.WARM
    await output(manager, "a1")  # restored
    assert manager.ledger.charge_of(ModelKey("a1", 1)) == 5 * MiB


async def test_base_is_held_while_an_adapter_serves(make_manager: MakeManager) -> None:
    manager, _ = make_manager({**MODELS, "other": 40}, budget_mib=100, load_timeout=0.3)
    async with manager.acquire("a1", 1):
        assert manager.entry(BASE).in_flight == 1  # type: ignore[union-attr]
        # 'other' needs the base's memory: nothing may go while the adapter serves.
        with pytest.raises(Unavailable) as refused:
            async with manager.acquire("other", 1):
                pass
        assert "adapter a1@1 runs on it" in refused.value.message
        assert state(manager, "base") is ModelState.LOADED
    assert manager.entry(BASE).in_flight == 0  # type: ignore[union-attr]


async def test_pressure_evicts_the_adapter_before_its_base(make_manager: MakeManager) -> None:
    # base 60 + a1 5 + a2 5 leave 30 MiB; 'other' needs 35: one adapter's leaving is enough.
    manager, _ = make_manager(MODELS, budget_mib=100, host_mib=100, eviction_policy="largest")
    await output(manager, "a1")
    await output(manager, "a2")
    async with manager.acquire("other", 1):
        pass
    await settled(manager)
    assert state(manager, "base") is ModelState.LOADED  # the largest, yet spared
    assert {state(manager, "a1"), state(manager, "a2")} == {ModelState.LOADED, ModelState.WARM}


async def test_base_eviction_parks_its_adapters_and_both_come_back_warm(
    make_manager: MakeManager,
) -> None:
    manager, loader = make_manager(
        {**MODELS, "other": 90}, budget_mib=100, host_mib=200, eviction_policy="largest"
    )
    before = await output(manager, "a1")
    async with manager.acquire("other", 1):  # needs everything: a1 leaves first, then base
        pass
    await settled(manager)
    assert state(manager, "a1") is ModelState.WARM and state(manager, "base") is ModelState.WARM
    assert manager.host_tier.used_bytes == 65 * MiB
    assert await output(manager, "a1") == before  # restores the base, then the adapter
    assert loader.loads[BASE] == 1 and loader.attaches[ModelKey("a1", 1)] == 1
    [a1] = [s for s in manager.status() if s.name == "a1"]
    assert a1.warm_load_s is not None and a1.cold_load_s is not None


async def test_unloading_the_base_takes_its_adapters_along(make_manager: MakeManager) -> None:
    manager, _ = make_manager(MODELS, budget_mib=100, host_mib=100)
    await output(manager, "a1")
    await manager.unload("base", 1)
    assert state(manager, "a1") is ModelState.UNLOADED  # its host copy lived in the base
    assert state(manager, "base") is ModelState.UNLOADED
    assert manager.host_tier.used_bytes == 0 and manager.ledger.used("cpu") == 0
    await output(manager, "a1")  # and it comes back, cold, base first
    assert state(manager, "base") is ModelState.LOADED


async def test_the_base_keep_alive_waits_for_its_adapters(make_manager: MakeManager) -> None:
    manager, _ = make_manager(
        {"base": {"bytes": 10 * MiB, "keep_alive": "0"}, "a1": {"bytes": MiB, "base": "base",
                                                                "keep_alive": "0.2"}},
        host_mib=100,
    )  # fmt: skip
    await output(manager, "a1")
    await asyncio.sleep(0.05)
    assert state(manager, "base") is ModelState.LOADED  # keep-alive 0, but a1 is on it
    for _ in range(100):
        if state(manager, "base") is ModelState.WARM:
            break
        await asyncio.sleep(0.02)
    assert state(manager, "a1") is ModelState.WARM and state(manager, "base") is ModelState.WARM


async def test_an_adapter_that_fails_to_attach_leaves_its_base_keep_alive_running(
    make_manager: MakeManager,
) -> None:
    manager, _ = make_manager(
        {"base": {"bytes": 10 * MiB, "keep_alive": "0.1"},
         "bad": {"bytes": MiB, "base": "base", "fail": True}},
        host_mib=100,
    )  # fmt: skip
    with pytest.raises(Unavailable):
        async with manager.acquire("bad", 1):
            pass
    assert state(manager, "bad") is ModelState.FAILED
    for _ in range(100):  # the base's idle clock runs: nothing rides on it
        if state(manager, "base") is ModelState.WARM:
            break
        await asyncio.sleep(0.02)
    assert state(manager, "base") is ModelState.WARM


async def test_an_adapter_requested_while_its_base_is_unloaded_waits_then_serves(
    make_manager: MakeManager,
) -> None:
    manager, loader = make_manager(MODELS, budget_mib=100, load_timeout=5)
    async with manager.acquire("base", 1):
        unloading = asyncio.create_task(manager.unload("base", 1))
        await asyncio.sleep(0.01)
        assert state(manager, "base") is ModelState.EVICTING  # draining the request
        adapter = asyncio.create_task(output(manager, "a1"))
        await asyncio.sleep(0.01)
    await unloading
    await adapter  # the adapter's load waited for the unload, then brought the base back
    assert state(manager, "base") is ModelState.LOADED and state(manager, "a1") is ModelState.LOADED
    assert loader.loads[BASE] == 2
