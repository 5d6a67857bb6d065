"""Measured footprints: the blocking lifecycle steps, each wrapped in its measurement.

A load's footprint is measured where it lands: on CUDA, the caching allocator's growth
across the load (weights, KV cache, workspaces, all of it); on the CPU, the bytes of the
backend's parameters, buffers and cache tensors (`Backend.memory_bytes`), since process RSS
moves with every other thread. Loads and restores on one CUDA device run one at a time so
each delta belongs to one model; other models' activations can still inflate it, which errs
on the safe side. The predicted footprint (safetensors headers, KV-cache reservation, plus
the configured overhead; on CUDA each tensor as the caching allocator rounds it, with no
flat allowance, the context being charged once to the device) is compared with the
measurement, and a prediction off by more than 10% is logged (`lifecycle.check_prediction`),
since the ledger then had to guess.

Unload frees memory for real: the backend empties its tensors and drops its references, and
on CUDA the allocator's cache is returned to the driver; an unload that did not bring the
allocator back near its level before the model gets a full garbage collection, then, if
that did not help, is logged as a leak.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping

from backends.base import Backend
from hub.gc_freeze import collect_everything
from hub.manager.devices import Device
from hub.manager.loader import PreparedVersion, VersionLoader, takes_device_budget
from hub.units import format_bytes

log = logging.getLogger(__name__)

# An unload on CUDA must give back at least this share of the model's measured bytes.
UNLOAD_TOLERANCE = 0.90


class Footprint:
    """Runs each blocking lifecycle step with its measurement; one load or restore at a time
    per CUDA device, so an allocator delta belongs to one model."""

    def __init__(self, devices: Iterable[Device], overhead_bytes: int = 0) -> None:
        self.overhead_bytes = overhead_bytes
        self._cuda_locks = {d.name: threading.Lock() for d in devices if d.is_cuda}

    def predict(self, prepared: PreparedVersion, budgets: Mapping[str, int]) -> dict[str, int]:
        """Predicted bytes on each device of `budgets` (device -> budget), overhead included.
        A CUDA device gets the backend's GPU prediction (what loading allocates there; the
        CUDA context is the device's, `Device.context_bytes`), a CPU the host one; one
        prediction serves every device of a kind unless the backend sizes itself by the
        budget. An adapter's slot is exact: no load overhead."""
        if prepared.base is not None:
            return dict.fromkeys(budgets, prepared.predict_memory())
        by_budget = takes_device_budget(prepared.backend_cls)
        out: dict[str, int] = {}
        per_kind: dict[bool, int] = {}
        for d, budget in budgets.items():
            cuda = d.startswith("cuda")
            if not by_budget and cuda in per_kind:
                out[d] = per_kind[cuda]
                continue
            given = budget if by_budget else None
            one = (
                prepared.predict_memory(given, device=d) if cuda else prepared.predict_memory(given)
            )
            out[d] = per_kind[cuda] = one + self.overhead_bytes
        return out

    def load(
        self, loader: VersionLoader, prepared: PreparedVersion, device: str, budget: int
    ) -> tuple[Backend, int]:
        """Load onto `device`; returns the backend and its measured footprint."""
        with self._allocator_delta(device) as delta:
            backend = loader.load(prepared, device, budget)
        return backend, self._measured(backend, delta)

    def attach(
        self, loader: VersionLoader, prepared: PreparedVersion, base: Backend, device: str
    ) -> tuple[Backend, int]:
        """Attach a LoRA adapter to `base` on `device`; returns it and its bytes, as the
        engine counts them. Not under the device's measuring lock, nor measured by the
        allocator: the base's engine allocates and frees activations meanwhile (its delta
        would be noise charged to the adapter), and an attach of milliseconds must not wait
        for another model's load on the device to end."""
        backend = loader.attach(prepared, base)
        return backend, backend.memory_bytes()

    def restore(self, backend: Backend, device: str) -> int:
        """Bring parked weights back onto `device`; returns the measured footprint (an
        adapter's: its own count, as for `attach`)."""
        if _is_adapter(backend):
            backend.restore(device)
            return backend.memory_bytes()
        with self._allocator_delta(device) as delta:
            backend.restore(device)
        return self._measured(backend, delta)

    def offload(self, backend: Backend, device: str) -> None:
        backend.offload()
        _release_cached(device)

    def dispose(self, backend: Backend, device: str | None, measured: int) -> None:
        """Unload for good. Backends free their tensors in `unload` (`backends.parking.
        release`), so no garbage collection is needed; on CUDA, where it can be measured, an
        unload that did not give the memory back gets a full collection, then a warning."""
        lock = self._cuda_locks.get(device) if device is not None else None
        with lock or contextlib.nullcontext():
            before = _allocated(device) if lock is not None else 0
            backend.unload()
            del backend
            if lock is None or measured <= 0:
                return
            freed = before - _allocated(device)
            if freed < UNLOAD_TOLERANCE * measured:
                # Reference cycles kept the tensors alive: a full collection (costly) frees them.
                collect_everything()
                freed = before - _allocated(device)
            _release_cached(device)
            if freed < UNLOAD_TOLERANCE * measured:
                log.warning(
                    "unloading from %s gave back %s of the %s measured at load: something "
                    "still holds device tensors", device, format_bytes(freed),
                    format_bytes(measured),
                )  # fmt: skip

    @contextlib.contextmanager
    def _allocator_delta(self, device: str) -> Iterator[list[int]]:
        """Yields a list that holds the CUDA allocator's growth once the block exits."""
        out: list[int] = []
        lock = self._cuda_locks.get(device)
        if lock is None:
            yield out
            return
        import torch

        with lock:
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            yield out
            torch.cuda.synchronize(device)
            out.append(torch.cuda.memory_allocated(device) - before)

    @staticmethod
    def _measured(backend: Backend, delta: list[int]) -> int:
        # The tensors the backend reports are a floor under the allocator's delta, which
        # another model freeing memory at the same moment could shrink.
        tensors = backend.memory_bytes()
        return max(tensors, delta[0]) if delta else tensors


def _is_adapter(backend: Backend) -> bool:
    from hub.adapters.binding import AdapterBackend  # imports torch: not at module load

    return isinstance(backend, AdapterBackend)


def _allocated(device: str | None) -> int:
    if device is None or not device.startswith("cuda"):
        return 0
    import torch

    torch.cuda.synchronize(device)
    return int(torch.cuda.memory_allocated(device))


def _release_cached(device: str | None) -> None:
    """Hand the CUDA allocator's cached blocks back to the driver, so the memory a model
    left is usable by other processes and visible as free; a no-op on the CPU."""
    if device is not None and device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
