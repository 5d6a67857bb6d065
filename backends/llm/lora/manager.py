"""The adapters of one loaded base: host copies, device slots, in-flight counts, step batches.

Contract (threads): `add`, `remove`, `acquire` and `release` may be called from any thread
(they take the manager's lock); `begin_step` / `end_step` and `move_to` belong to the engine
thread. `add` reads the adapter's tensors into host memory (page-locked when the base is on
an accelerator), in the base's dtype with the scaling folded into `B`, and wraps the base's
target layers in `LoRALinear` (in place: the base's weights are neither reloaded nor
copied). A step's adapters are copied into device slots on demand (`SlotTable`, least
recently used out, at most `max_loras`); an adapter pushed out keeps its host copy.
`remove` waits up to `wait_s` for the adapter's requests in flight to end (an aborted request
leaves at the engine's next step boundary), then refuses with `AdapterInUseError`: the hub
never evicts an adapter that serves, so this is a guard, not a queue.

Each load of a key gets its own prefix-cache root (`acquire` returns it), so KV blocks are
never shared between adapters, between an adapter and the base, or across reloads of a key.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from backends.errors import CapacityError, InputError
from backends.llm.lora.adapter import WEIGHTS_FILE, AdapterError, AdapterSpec
from backends.llm.lora.layers import LoRABatch, LoRAContext, LoRALinear, StackedLoRA, wrap_linear
from backends.llm.lora.slots import SlotTable

_loads = itertools.count(1)


class AdapterInUseError(CapacityError):
    """The adapter has requests in flight; unload it once they finish."""


@dataclass(frozen=True)
class _Weights:
    """An adapter's matrices per module name: A `(r, in)`, B scaled and transposed `(r, out)`."""

    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())

    def to(self, device: torch.device) -> _Weights:
        blocking = device.type == "cpu"
        return _Weights(
            {
                name: (
                    a.to(device, non_blocking=not blocking),
                    b.to(device, non_blocking=not blocking),
                )
                for name, (a, b) in self.modules.items()
            }
        )


@dataclass(frozen=True)
class _Adapter:
    key: str
    spec: AdapterSpec
    host: _Weights
    # Prefix-cache root of this load (see the module docstring).
    root_hash: int


class LoRAManager:
    """Adapters of one base model; see the module docstring for the threading contract."""

    def __init__(
        self, model: Any, device: torch.device, dtype: torch.dtype, *, max_loras: int, max_rank: int
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.context = LoRAContext()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a request is released
        self._adapters: dict[str, _Adapter] = {}
        self._in_flight: Counter[str] = Counter()
        self._layers: dict[str, LoRALinear] = {}
        self._slots = SlotTable(max_loras)
        self._resident: dict[str, _Weights] = {}  # key -> device copy (those in slots)
        # Stacks of the last step's adapter list, reused while the list stays the same.
        self._stacks_for: tuple[str, ...] = ()
        self._stacks: dict[str, StackedLoRA] = {}
        # Copies from host memory into a slot, and how long the last one took.
        self.slot_loads = 0
        self.last_slot_load_s = 0.0

    # ---- any thread -----------------------------------------------------------------------
    def add(self, key: str, spec: AdapterSpec) -> int:
        """Read `spec`'s tensors into host memory and make the adapter usable; returns its
        device bytes. A key already loaded is replaced (refused while it serves)."""
        if spec.rank > self.max_rank:
            raise AdapterError(
                f"adapter {key} has rank {spec.rank}, above this model's max_lora_rank="
                f"{self.max_rank}; raise max_lora_rank in the base's runtime config",
                param="r",
            )
        for m in spec.modules:
            try:
                layer = self.model.get_submodule(m.module)
            except AttributeError:
                raise AdapterError(f"the base model has no module {m.module}") from None
            width = (getattr(layer, "in_features", None), getattr(layer, "out_features", None))
            if width != (m.in_features, m.out_features):
                raise AdapterError(
                    f"{m.module}: the adapter maps {m.in_features} -> {m.out_features} features, "
                    f"the base's layer {width[0]} -> {width[1]}"
                )
        host = self._read(spec)
        adapter = _Adapter(key, spec, host, hash(("lora", key, next(_loads))))
        with self._lock:
            if self._in_flight[key]:
                raise AdapterInUseError(f"adapter {key} is serving requests; it cannot be replaced")
            for m in spec.modules:
                if m.module not in self._layers:
                    self._layers[m.module] = wrap_linear(self.model, m.module, self.context)
            self._forget_device(key)
            self._adapters[key] = adapter
        return 2 * host.nbytes

    def remove(self, key: str, wait_s: float = 5.0) -> None:
        """Forget the adapter (host copy and slot). Waits up to `wait_s` for its requests in
        flight to end, then raises AdapterInUseError."""
        with self._lock:
            if key not in self._adapters:
                raise InputError(f"adapter {key} is not loaded", param="model")
            self._idle.wait_for(lambda: not self._in_flight[key], timeout=wait_s)
            if self._in_flight[key]:
                raise AdapterInUseError(
                    f"adapter {key} has {self._in_flight[key]} request(s) in flight; unload it "
                    "once they finish"
                )
            del self._adapters[key]
            self._forget_device(key)

    def loaded(self) -> dict[str, int]:
        with self._lock:
            return {key: 2 * a.host.nbytes for key, a in self._adapters.items()}

    @property
    def slots_in_use(self) -> int:
        return len(self._slots.resident)

    def resident(self) -> list[str]:
        """Adapters in device slots now, least recently used first."""
        with self._lock:
            return self._slots.resident

    def peek(self, key: str) -> int:
        """The prefix-cache root of `key`'s current load; InputError when it is not loaded."""
        with self._lock:
            return self._find(key).root_hash

    def acquire(self, key: str) -> int:
        """Count a request of `key` in flight; returns its prefix-cache root. InputError for
        an adapter that is not loaded."""
        with self._lock:
            adapter = self._find(key)
            self._in_flight[key] += 1
            return adapter.root_hash

    def release(self, key: str) -> None:
        with self._lock:
            self._in_flight[key] -= 1
            if self._in_flight[key] <= 0:
                del self._in_flight[key]
                self._idle.notify_all()

    def in_flight(self, key: str) -> int:
        with self._lock:
            return self._in_flight[key]

    # ---- engine thread ------------------------------------------------------------------
    def begin_step(self, segments: Sequence[tuple[str | None, int]]) -> None:
        """Set the step's batch: `segments` are runs of packed tokens, `(adapter or None,
        count)` in packing order. A step of the base alone sets none."""
        # Sorted, so that the stacks of a set of adapters are reused whatever the order.
        keys = sorted({k for k, _ in segments if k is not None})
        if not keys:
            self.context.batch = None
            return
        with self._lock:
            self._place(keys)
            if tuple(keys) != self._stacks_for:
                self._stacks = self._stack(keys)
                self._stacks_for = tuple(keys)
            stacks = self._stacks
        index = {k: i for i, k in enumerate(keys)}
        runs = [(-1 if k is None else index[k], n) for k, n in segments]
        self.context.batch = LoRABatch(runs, stacks, self.dtype, self.device)

    def end_step(self) -> None:
        self.context.batch = None

    def ensure_resident(self, keys: Sequence[str]) -> None:
        """Copy `keys` into device slots now (what a step does on demand)."""
        with self._lock:
            self._place(list(keys))

    def evict(self, key: str) -> None:
        """Push `key` out of its device slot (its host copy stays)."""
        with self._lock:
            self._forget_device(key)

    def move_to(self, device: torch.device) -> None:
        """The base moved (offload, restore): drop every slot; they refill on demand."""
        with self._lock:
            for key in self._slots.resident:
                self._forget_device(key)
            self.device = device

    # ---- helpers (under the lock) -----------------------------------------------------------
    def _find(self, key: str) -> _Adapter:
        adapter = self._adapters.get(key)
        if adapter is None:
            known = ", ".join(sorted(self._adapters)) or "none"
            raise InputError(
                f"adapter {key!r} is not loaded on this model (loaded: {known})", param="model"
            )
        return adapter

    def _read(self, spec: AdapterSpec) -> _Weights:
        from safetensors.torch import load_file

        try:
            tensors = load_file(spec.folder / WEIGHTS_FILE)  # one call: faster than per tensor
        except Exception as e:
            raise AdapterError(f"cannot read the adapter's tensors in {spec.folder}: {e}") from e
        pin = self.device.type == "cuda"
        modules = {}
        for m in spec.modules:
            a = tensors[m.a_key].to(self.dtype).contiguous()
            # Scaled in float32, then transposed to (r, out): the stacked layout of a step.
            b = (tensors[m.b_key].float() * m.scaling).t().to(self.dtype).contiguous()
            modules[m.module] = (a.pin_memory(), b.pin_memory()) if pin else (a, b)
        return _Weights(modules)

    def _place(self, keys: list[str]) -> None:
        for placement in self._slots.assign(keys):
            if placement.evicted is not None:
                self._resident.pop(placement.evicted, None)
            adapter = self._adapters.get(placement.key)
            if adapter is None:
                self._slots.drop(placement.key)
                raise RuntimeError(f"adapter {placement.key} was unloaded with requests in flight")
            started = time.perf_counter()
            self._resident[placement.key] = adapter.host.to(self.device)
            self.slot_loads += 1
            self.last_slot_load_s = time.perf_counter() - started
            self._stacks_for = ()  # a slot changed: rebuild the stacks

    def _stack(self, keys: list[str]) -> dict[str, StackedLoRA]:
        """Per module, the stacked matrices of the adapters in `keys` that target it."""
        per_module: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for i, key in enumerate(keys):
            for name, (a, b) in self._resident[key].modules.items():
                per_module.setdefault(name, []).append((i, a, b))
        stacks = {}
        for name, parts in per_module.items():
            rank = max(a.shape[0] for _, a, _ in parts)
            _, a0, b0 = parts[0]
            a_stack = a0.new_zeros(len(parts), a0.shape[1], rank)  # (k, in, r)
            b_stack = b0.new_zeros(len(parts), rank, b0.shape[1])  # (k, r, out)
            for j, (_, a, b) in enumerate(parts):
                a_stack[j, :, : a.shape[0]] = a.t()
                b_stack[j, : b.shape[0]] = b
            stacks[name] = StackedLoRA(a_stack, b_stack, tuple(i for i, _, _ in parts))
        return stacks

    def _forget_device(self, key: str) -> None:
        self._slots.drop(key)
        self._resident.pop(key, None)
        if key in self._stacks_for:
            self._stacks_for = ()
            self._stacks = {}
