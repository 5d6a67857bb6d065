"""The hub's dependencies (the registry database, MLflow, the accelerators): bounded blocking
calls to them and a background check of whether they answer, which readiness and metrics
read; per GPU, NVML's figures on the same schedule."""

from hub.dependencies.calls import BoundedCalls
from hub.dependencies.devices import DeviceHealth, DeviceMonitor, probe_device
from hub.dependencies.gpu_metrics import GpuReading
from hub.dependencies.monitor import DependencyMonitor, DependencyState

__all__ = [
    "BoundedCalls",
    "DependencyMonitor",
    "DependencyState",
    "DeviceHealth",
    "DeviceMonitor",
    "GpuReading",
    "probe_device",
]
