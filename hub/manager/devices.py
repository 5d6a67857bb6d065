"""Devices the manager may place models on, with their budgets resolved to bytes."""

from __future__ import annotations

import os
from dataclasses import dataclass

from hub.settings import DeviceSettings


def total_memory(device: str) -> int:
    """Physical memory of a device: system RAM for `cpu`, device memory for `cuda:N`."""
    if device == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"device {device} is configured but CUDA is not available")
    index = int(device.split(":", 1)[1])
    if index >= torch.cuda.device_count():
        raise RuntimeError(
            f"device {device} is configured but only {torch.cuda.device_count()} CUDA devices exist"
        )
    return int(torch.cuda.get_device_properties(index).total_memory)


# What the CUDA context of this process holds on each device it touches (the driver's
# state, the kernels of torch and its libraries loaded lazily, cuBLAS workspaces): outside
# the caching allocator, so no load's measured growth shows it. Charged once per device.
CUDA_CONTEXT_BYTES = 512 * 2**20


@dataclass(frozen=True)
class Device:
    """A device and the bytes the manager may charge to it. `context_bytes` of the budget
    go to the device itself (a CUDA context), the rest to models (`model_budget_bytes`)."""

    name: str
    budget_bytes: int
    context_bytes: int = 0

    @property
    def is_cuda(self) -> bool:
        return self.name.startswith("cuda")

    @property
    def model_budget_bytes(self) -> int:
        return max(0, self.budget_bytes - self.context_bytes)

    @classmethod
    def from_settings(cls, settings: DeviceSettings) -> Device:
        budget = settings.memory_budget
        if isinstance(budget, float):
            budget = int(total_memory(settings.name) * budget)
        context = CUDA_CONTEXT_BYTES if settings.name.startswith("cuda") else 0
        return cls(settings.name, int(budget), context)
