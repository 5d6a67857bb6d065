"""Host <-> device copies that do not stall the device's queue.

On CUDA a copy from pageable host memory, or any `.item()` / `.tolist()` / `.cpu()` of a device
tensor, waits for every kernel queued before it. A sampling step therefore sends what the host
knows in two copies from pinned memory (`upload_fields`, non-blocking: the device reads them
in stream order) and brings back everything the host needs in one (`download`), then waits
once. On the CPU both are plain tensors, no copy.
"""

from __future__ import annotations

from typing import Any

import torch


def pinned(device: torch.device) -> bool:
    """Whether host buffers bound for `device` are page-locked (CUDA only)."""
    return device.type == "cuda"


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor, pinned where `pinned(device)`) on `device`, queued without a
    wait. The caching host allocator keeps a pinned buffer alive until its copy is done."""
    if device.type == "cpu":
        return host
    return host.to(device, non_blocking=host.is_pinned())


def upload_fields(
    ints: dict[str, list[int]], floats: dict[str, list[float]], device: torch.device
) -> dict[str, torch.Tensor]:
    """Each named non-empty list as a tensor on `device` (int64 and float32; empty lists are
    left out), from one copy per dtype: the lists are packed into one host tensor each and
    split on the device (views)."""
    out: dict[str, torch.Tensor] = {}
    for given, dtype in ((ints, torch.int64), (floats, torch.float32)):
        fields = {name: values for name, values in given.items() if values}
        if not fields:
            continue
        flat = [v for values in fields.values() for v in values]
        packed = upload(torch.tensor(flat, dtype=dtype, pin_memory=pinned(device)), device)
        sizes = [len(values) for values in fields.values()]
        out.update(zip(fields, packed.split(sizes), strict=True))
    return out


def download(packed: torch.Tensor) -> torch.Tensor:
    """`packed` on the host: one device-to-host copy into pinned memory, then one wait."""
    return start_download(packed).wait()


class Download:
    """A device-to-host copy queued on the device's stream; `wait` returns the host tensor
    once the copy (and everything queued before it) is done."""

    def __init__(self, host: torch.Tensor, done: Any | None) -> None:
        self.host = host
        self.done = done

    def wait(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        return self.host


def start_download(packed: torch.Tensor) -> Download:
    """Queue the copy of `packed` to pinned host memory without waiting (CUDA); elsewhere
    the tensor itself, or a plain copy."""
    if packed.device.type == "cpu":
        return Download(packed, None)
    if packed.device.type != "cuda":
        return Download(packed.cpu(), None)
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(packed.device))
    return Download(host, done)
