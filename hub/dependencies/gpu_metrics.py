"""Per-GPU readings from NVML (`nvidia-ml-py`): utilisation, memory, temperature, power.

The driver's management library answers whatever the processes on the GPU are doing, so
these figures include other tenants' use of a shared GPU, which the manager's ledger cannot
see. Without a driver (a CPU host) `open_nvml` says so once at INFO and returns None: the hub
then exports no GPU metrics at all rather than zeros that look like an idle GPU.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Gauge

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuReading:
    """One device's figures at one moment. `utilization` is the share of the last sample
    period in which a kernel ran (0 to 1), as `nvidia-smi` shows it in percent."""

    utilization: float
    memory_used_bytes: int
    memory_total_bytes: int
    temperature_c: float
    power_w: float

    def report(self) -> dict[str, float | int]:
        return asdict(self)


class GpuReader(Protocol):
    """Reads one configured device (`cuda:N`); raises when it cannot."""

    def read(self, device: str) -> GpuReading: ...


def nvml_index(device: str, visible: str | None = None) -> int:
    """The NVML (physical) index of `cuda:N`: CUDA numbers the devices CUDA_VISIBLE_DEVICES
    lists, NVML all of them. A list of UUIDs is matched by NVML itself (see NvmlReader)."""
    ordinal = int(device.split(":", 1)[1]) if ":" in device else 0
    if not visible:
        return ordinal
    listed = [v.strip() for v in visible.split(",") if v.strip()]
    if ordinal < len(listed) and listed[ordinal].isdigit():
        return int(listed[ordinal])
    return ordinal


class NvmlReader:
    """Reads devices through NVML; `__init__` raises (pynvml.NVMLError) without a driver."""

    def __init__(self, visible: str | None = None) -> None:
        import pynvml

        self._nvml: Any = pynvml
        pynvml.nvmlInit()
        self._visible = visible
        self._handles: dict[str, Any] = {}

    def _handle(self, device: str) -> Any:
        handle = self._handles.get(device)
        if handle is None:
            listed = [v.strip() for v in (self._visible or "").split(",") if v.strip()]
            ordinal = int(device.split(":", 1)[1]) if ":" in device else 0
            if ordinal < len(listed) and listed[ordinal].startswith(("GPU-", "MIG-")):
                handle = self._nvml.nvmlDeviceGetHandleByUUID(listed[ordinal])
            else:
                handle = self._nvml.nvmlDeviceGetHandleByIndex(nvml_index(device, self._visible))
            self._handles[device] = handle
        return handle

    def read(self, device: str) -> GpuReading:
        nvml = self._nvml
        handle = self._handle(device)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        rates = nvml.nvmlDeviceGetUtilizationRates(handle)
        temperature = nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
        power_mw = nvml.nvmlDeviceGetPowerUsage(handle)
        return GpuReading(
            utilization=rates.gpu / 100.0,
            memory_used_bytes=int(memory.used),
            memory_total_bytes=int(memory.total),
            temperature_c=float(temperature),
            power_w=power_mw / 1000.0,
        )

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def open_nvml(visible: str | None = None) -> NvmlReader | None:
    """An NVML reader, or None (logged once at INFO) where NVML cannot start: no NVIDIA
    driver, or `nvidia-ml-py` not installed. `visible` is CUDA_VISIBLE_DEVICES."""
    try:
        return NvmlReader(
            visible if visible is not None else os.environ.get("CUDA_VISIBLE_DEVICES")
        )
    except Exception as e:
        log.info("NVML is not available (%s: %s): no GPU metrics", type(e).__name__, e)
        return None


class GpuGauges:
    """The Prometheus gauges of the readings, labelled by device; registered only when a
    reader exists, so a host without NVML exports none of them."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["device"], registry=registry)

        self.utilization = gauge(
            "hub_gpu_utilization_ratio", "Share of time a kernel ran on the GPU (NVML, 0-1)"
        )
        self.memory_used = gauge(
            "hub_gpu_memory_used_bytes", "GPU memory in use by every process (NVML)"
        )
        self.memory_total = gauge("hub_gpu_memory_total_bytes", "GPU memory in all (NVML)")
        self.temperature = gauge("hub_gpu_temperature_celsius", "GPU core temperature (NVML)")
        self.power = gauge("hub_gpu_power_watts", "GPU power draw (NVML)")

    def set(self, device: str, r: GpuReading) -> None:
        self.utilization.labels(device).set(r.utilization)
        self.memory_used.labels(device).set(r.memory_used_bytes)
        self.memory_total.labels(device).set(r.memory_total_bytes)
        self.temperature.labels(device).set(r.temperature_c)
        self.power.labels(device).set(r.power_w)
