"""A backend that really holds memory, and a loader serving it, for testing the manager's
policies without a registry: each "model" is a tensor of a given size whose values depend on
its name, so placement, eviction, the host tier and restores act on real allocations.

Runtime config keys of a fake model: `bytes` (its footprint), `predict` (what it claims
before loading; default `bytes`), `base` (the name of the model it is a LoRA adapter of:
version 1 of it), `fail` (its load, or an adapter's attach, raises), `load_seconds` (a slow load),
`offload_seconds` (a slow offload),
`cache_fraction` (a cache sized as that share of the device budget, like an LLM's KV cache),
plus the manager's own `keep_alive`, `pin`, `device`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from backends.base import Backend, BackendContext, ModelKind
from backends.errors import BackendClosedError, LoadError
from backends.loading import module_bytes
from backends.parking import ParkedWeights, park
from hub.manager.state import ModelKey


class FakeBackend(Backend):
    kind = ModelKind.EMBEDDER

    def __init__(self, context: BackendContext) -> None:
        super().__init__(context)
        self.module: torch.nn.Module | None = None
        self._parked: ParkedWeights | None = None

    @classmethod
    def predict_memory(
        cls,
        artifact_dir: Path,
        runtime_config: Mapping[str, Any],
        *,
        device_budget_bytes: int | None = None,
    ) -> int:
        cache = int(runtime_config.get("cache_fraction", 0) * (device_budget_bytes or 0))
        return int(runtime_config.get("predict", runtime_config["bytes"])) + cache

    def load(self, artifact_dir: Path, device: str, dtype: torch.dtype | None = None) -> None:
        config = self.context.runtime_config
        time.sleep(float(config.get("load_seconds", 0)))
        if config.get("fail"):
            raise LoadError(f"{self.context.model} is broken on purpose")
        seed = sum(map(ord, self.context.model)) + int(self.context.version)
        module = torch.nn.Module()
        # Values that differ per model and along the tensor, cheap to make at any size.
        values = torch.empty(int(config["bytes"]) // 4).fill_(seed)
        values[:4096] = torch.arange(min(4096, values.numel())) * seed
        module.weight = torch.nn.Parameter(values.to(device), requires_grad=False)
        # A cache sized as a share of the device's budget, as an LLM's KV cache can be.
        fraction = float(config.get("cache_fraction", 0))
        cache_bytes = int(fraction * (self.context.device_budget_bytes or 0))
        module.register_buffer("cache", torch.zeros(cache_bytes, dtype=torch.uint8))
        self.module = module
        self._device = device

    def memory_bytes(self) -> int:
        if self.module is None or self._parked is not None:
            return 0
        return module_bytes(self.module)

    def offload(self) -> None:
        time.sleep(float(self.context.runtime_config.get("offload_seconds", 0)))
        if self.module is None:
            raise BackendClosedError(f"{self.context.model} was unloaded during its offload")
        self._parked = park(self.module)
        self._device = "cpu"

    def restore(self, device: str) -> None:
        assert self._parked is not None
        self._parked.restore(device)
        self._parked = None
        self._device = device

    def unload(self) -> None:
        self.module = None
        self._parked = None
        self._device = None

    def run(self) -> float:
        """The model's "output": a checksum of its weights."""
        if self.module is None or self._parked is not None:
            raise BackendClosedError(f"{self.context.model} is not resident")
        return float(self.module.weight.double().sum())


class FakeAdapter(Backend):
    """A LoRA adapter on a `FakeBackend`: its output is its base's plus its own offset, and
    it needs its base resident to give one."""

    kind = ModelKind.LLM

    def __init__(self, context: BackendContext, base: FakeBackend) -> None:
        super().__init__(context)
        self.base = base
        self.nbytes = int(context.runtime_config["bytes"])
        self.offset = sum(map(ord, context.model)) + int(context.version)

    @classmethod
    def predict_memory(cls, artifact_dir: Path, runtime_config: Mapping[str, Any]) -> int:
        # `predict` apart from `bytes`: a real adapter's file dtype may differ from its base's.
        return int(runtime_config.get("predict", runtime_config["bytes"]))

    def load(self, artifact_dir: Path, device: str, dtype: torch.dtype | None = None) -> None:
        if self.context.runtime_config.get("fail"):
            raise LoadError(f"adapter {self.context.model} does not fit its base, on purpose")
        self._device = device

    def memory_bytes(self) -> int:
        return self.nbytes if self._device is not None else 0

    def offload_bytes(self) -> int:
        return self.nbytes

    def offload(self) -> None:
        self._device = None

    def restore(self, device: str) -> None:
        self._device = device

    def unload(self) -> None:
        self._device = None

    def run(self) -> float:
        if self._device is None:
            raise BackendClosedError(f"adapter {self.context.model} is not attached")
        return self.base.run() + self.offset


@dataclass
class FakePrepared:
    view: Any
    config: dict[str, Any]
    backend_cls: type[Backend] = FakeBackend
    base: ModelKey | None = None

    def predict_memory(self, device_budget_bytes: int | None = None) -> int:
        if self.base is not None:
            return FakeAdapter.predict_memory(Path("."), self.config)
        return FakeBackend.predict_memory(
            Path("."), self.config, device_budget_bytes=device_budget_bytes
        )


@dataclass
class FakeLoader:
    """Serves fake models by name (every version shares the name's config)."""

    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    loads: dict[ModelKey, int] = field(default_factory=dict)
    attaches: dict[ModelKey, int] = field(default_factory=dict)
    backends: list[FakeBackend] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def prepare(self, key: ModelKey) -> FakePrepared:
        config = self.models[key.name]
        view = SimpleNamespace(
            name=key.name, version=key.version, kind="embedder", runtime_config=config
        )
        if "base" in config:
            return FakePrepared(view, config, FakeAdapter, ModelKey(config["base"], 1))
        return FakePrepared(view, config)

    def attach(self, prepared: FakePrepared, base: Backend) -> Backend:
        assert isinstance(base, FakeBackend) and base.device is not None
        view = prepared.view
        context = BackendContext(view.name, str(view.version), prepared.config)
        adapter = FakeAdapter(context, base)
        with self._lock:
            key = ModelKey(view.name, view.version)
            self.attaches[key] = self.attaches.get(key, 0) + 1
        adapter.load(Path("."), base.device)
        return adapter

    def load(
        self, prepared: FakePrepared, device: str, device_budget: int | None = None
    ) -> Backend:
        view = prepared.view
        context = BackendContext(
            view.name, str(view.version), prepared.config, device_budget_bytes=device_budget
        )
        backend = FakeBackend(context)
        with self._lock:
            key = ModelKey(view.name, view.version)
            self.loads[key] = self.loads.get(key, 0) + 1
        backend.load(Path("."), device)
        self.backends.append(backend)
        return backend
