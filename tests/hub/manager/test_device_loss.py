"""A device that stopped computing (a crashed CUDA context, found by the probe in
hub.dependencies.devices): its models fail with the reason, nothing is placed there again,
a request goes to another device or is refused naming the lost one; and a CUDA device's
context is charged once to the device, not to each model."""

from __future__ import annotations

import pytest

from hub.errors import Unavailable
from hub.manager import Device, ModelManager
from hub.metrics import HubMetrics
from hub.settings import ManagerSettings
from tests.hub.manager.conftest import MakeManager, MiB
from tests.support.fake_models import FakeLoader


async def test_a_lost_device_fails_its_models_and_refuses_new_loads(
    make_manager: MakeManager,
) -> None:
    manager, _ = make_manager({"a": 10, "b": 10})
    async with manager.acquire("a", 1):
        pass
    manager.device_lost("cpu", "CUDA error: an illegal memory access was encountered")

    [row] = manager.status()
    assert (row.state, row.device) == ("failed", None)
    assert row.error == "device cpu is lost (CUDA error: an illegal memory access was encountered)"
    [device] = manager.device_status()
    assert (device.usable, device.used_bytes, device.models) == (False, 0, 0)
    assert device.error is not None and "illegal memory access" in device.error
    for name in ("a", "b"):  # a failed one and one never loaded alike
        with pytest.raises(Unavailable) as caught:
            async with manager.acquire(name, 1):
                pass
        assert caught.value.code == "device_lost"
        assert "device cpu is lost" in caught.value.message


async def test_a_model_on_a_lost_device_comes_back_on_another() -> None:
    loader = FakeLoader({"a": {"bytes": 10 * MiB}})
    manager = ModelManager(
        ManagerSettings(min_residency=0, load_timeout=10, idle_check_interval=0.05),
        [Device("cpu", 100 * MiB), Device("cpu:1", 100 * MiB)],
        loader,  # type: ignore[arg-type]
        HubMetrics(),
    )
    try:
        async with manager.acquire("a", 1):
            pass
        [first] = manager.status()
        assert first.device is not None
        manager.device_lost(first.device, "did not finish a probe kernel within 10s")
        async with manager.acquire("a", 1) as backend:
            assert backend.device is not None
        [again] = manager.status()
        assert again.state == "loaded"
        assert again.device not in (None, first.device)
    finally:
        await manager.close()


async def test_the_cuda_context_is_charged_once_to_the_device() -> None:
    context = 300 * MiB
    loader = FakeLoader({"a": {"bytes": 10 * MiB}})
    manager = ModelManager(
        ManagerSettings(min_residency=0),
        [Device("cpu", 1024 * MiB, context_bytes=context)],
        loader,  # type: ignore[arg-type]
        HubMetrics(),
    )
    try:
        [empty] = manager.device_status()
        assert (empty.context_bytes, empty.used_bytes) == (context, context)
        assert empty.free_bytes == 1024 * MiB - context
        async with manager.acquire("a", 1):
            pass
        [device] = manager.device_status()
        [row] = manager.status()
        assert device.used_bytes == context + row.measured_bytes
        assert row.predicted_bytes < 20 * MiB  # the context is not the model's
    finally:
        await manager.close()
