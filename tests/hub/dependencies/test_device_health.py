"""A device that stops computing makes the replica unready and its models failed: a probe
kernel that hangs or raises (a crashed CUDA context) is driven here by an injected probe;
the real probe is a no-op that answers healthy on a CPU. NVML's figures reach /metrics and
/admin/devices through an injected reader; without a driver (this host) NVML really fails
and the hub exports no GPU metrics."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from hub.dependencies import DeviceMonitor, GpuReading, probe_device
from hub.dependencies.gpu_metrics import nvml_index, open_nvml
from tests.support.hubs import make_settings, running_app


def hangs_on(release: threading.Event):
    def probe(device: str) -> None:
        release.wait(timeout=30)

    return probe


def lost_context(device: str) -> None:
    raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore text")


def test_the_real_probe_answers_healthy_on_a_cpu() -> None:
    assert probe_device("cpu") is None


async def test_a_probe_that_hangs_loses_the_device_once() -> None:
    release = threading.Event()
    heard: list[tuple[str, str]] = []
    monitor = DeviceMonitor(["cuda:0"], interval=0.05, timeout=0.2, probe=hangs_on(release),
                            reader=None, metrics_registry=CollectorRegistry())  # fmt: skip
    monitor.on_lost(lambda d, why: heard.append((d, why)))
    try:
        await monitor.check_now()
        assert monitor.lost() == {"cuda:0": "did not finish a probe kernel within 0.2s"}
        monitor.start()
        await asyncio.sleep(0.3)  # later rounds never probe a lost device again
        assert heard == [("cuda:0", "did not finish a probe kernel within 0.2s")]
    finally:
        release.set()
        await monitor.stop()


async def test_a_cuda_error_loses_the_device_with_its_message() -> None:
    calls: list[str] = []

    def probe(device: str) -> None:
        calls.append(device)
        if device == "cuda:1":
            lost_context(device)

    monitor = DeviceMonitor(["cuda:0", "cuda:1"], interval=1, timeout=5, probe=probe,
                            reader=None, metrics_registry=CollectorRegistry())  # fmt: skip
    await monitor.check_now()
    health = monitor.health()
    assert health["cuda:0"].usable is True
    assert health["cuda:1"].usable is False
    assert health["cuda:1"].error == (
        "RuntimeError: CUDA error: an illegal memory access was encountered"
    )
    await monitor.check_now()
    assert calls.count("cuda:1") == 1
    await monitor.stop()


class FixedReader:
    def read(self, device: str) -> GpuReading:
        gib = 2**30
        return GpuReading(0.42, 3 * gib, 80 * gib, temperature_c=51.0, power_w=312.5)


async def test_nvml_readings_are_exported_per_device() -> None:
    registry = CollectorRegistry()
    monitor = DeviceMonitor(["cuda:0"], interval=1, timeout=5, probe=lambda d: None,
                            reader=FixedReader(), metrics_registry=registry)  # fmt: skip
    await monitor.check_now()

    def value(name: str) -> float | None:
        return registry.get_sample_value(name, {"device": "cuda:0"})

    assert value("hub_gpu_utilization_ratio") == 0.42
    assert value("hub_gpu_memory_used_bytes") == 3 * 2**30
    assert value("hub_gpu_memory_total_bytes") == 80 * 2**30
    assert value("hub_gpu_temperature_celsius") == 51.0
    assert value("hub_gpu_power_watts") == 312.5
    assert value("hub_device_usable") == 1
    assert monitor.readings()["cuda:0"].power_w == 312.5
    await monitor.stop()


async def test_without_a_driver_nvml_is_reported_once_and_no_gpu_metric_exported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("pynvml")
    with caplog.at_level(logging.INFO, logger="hub.dependencies.gpu_metrics"):
        if open_nvml() is not None:
            pytest.skip("this host has an NVIDIA driver")
        caplog.clear()
        registry = CollectorRegistry()
        monitor = DeviceMonitor(["cuda:0"], interval=1, timeout=5, probe=lambda d: None,
                                metrics_registry=registry)  # fmt: skip
        await monitor.check_now()
        await monitor.check_now()
        await monitor.stop()
    notes = [r for r in caplog.records if "NVML is not available" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO
    assert "hub_gpu_" not in generate_latest(registry).decode()
    assert monitor.readings() == {}


def test_cuda_ordinals_follow_cuda_visible_devices() -> None:
    assert nvml_index("cuda:1") == 1
    assert nvml_index("cuda:1", "3,5") == 5
    assert nvml_index("cuda:0", "GPU-abc") == 0


async def test_a_lost_device_makes_the_replica_unready_and_its_models_failed(
    tmp_path: Path, mlflow_template: Path, tiny_embedder_dir: Path
) -> None:
    models = [{"name": "emb", "kind": "embedder", "source": str(tiny_embedder_dir),
               "preload": True}]  # fmt: skip
    settings = make_settings(tmp_path / "hub", mlflow_template, models=models)
    async with running_app(settings) as (app, client):
        for _ in range(600):
            if (await client.get("/health/ready")).status_code == 200:
                break
            await asyncio.sleep(0.05)
        assert (
            await client.post("/v1/embeddings", json={"model": "emb", "input": "a"})
        ).status_code == 200
        hub = app.state.hub
        # The CPU device stands in for a GPU whose context crashed.
        monitor = DeviceMonitor(["cpu"], interval=1, timeout=5, probe=lost_context,
                                reader=None, metrics_registry=CollectorRegistry())  # fmt: skip
        monitor.on_lost(hub.manager.device_lost)
        hub.dependencies.devices = monitor
        await monitor.check_now()

        r = await client.get("/health/ready")
        assert r.status_code == 503
        body = r.json()
        assert "cpu" in body["status"] and "illegal memory access" in body["status"]
        assert body["devices"]["cpu"]["usable"] is False
        [model] = (await client.get("/admin/models")).json()
        assert model["state"] == "failed"
        assert "device cpu is lost" in model["error"]
        [device] = (await client.get("/admin/devices")).json()["devices"]
        assert device["usable"] is False and device["used_bytes"] == 0
        r = await client.post("/v1/embeddings", json={"model": "emb", "input": "a"})
        assert r.status_code == 503
        assert "device cpu is lost" in r.json()["error"]["message"]
        await monitor.stop()


@pytest.mark.cuda
async def test_a_healthy_gpu_answers_its_probe_and_nvml_reads_it() -> None:
    probe_device("cuda:0")
    registry = CollectorRegistry()
    monitor = DeviceMonitor(["cuda:0"], interval=1, timeout=10, metrics_registry=registry)
    await monitor.check_now()
    assert monitor.lost() == {}
    reading = monitor.readings().get("cuda:0")
    if reading is not None:  # NVML present: the same GPU torch sees
        assert 0 < reading.memory_used_bytes <= reading.memory_total_bytes
        total = registry.get_sample_value("hub_gpu_memory_total_bytes", {"device": "cuda:0"})
        assert total == reading.memory_total_bytes
    await monitor.stop()
