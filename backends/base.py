"""The lifecycle every model kind implements, whatever it serves.

A backend is created for one model version, then `load`ed onto a device. The manager may later
`offload` it to host memory (weights kept, device memory released), `restore` it onto a device,
and finally `unload` it, after which no tensor of it stays referenced. `memory_bytes` reports
what the backend holds on its device right now, measured, not predicted; `predict_memory`
answers before loading from the safetensors headers and the runtime config.

Each kind adds its own async work method (`generate`/`stream`, `embed`, `rerank`) and owns the
queue that batches concurrent requests. Backends know nothing about HTTP, the registry or the
hub: they take tensors, strings and token ids and raise the errors in `backends.errors`.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from prometheus_client import CollectorRegistry

from backends.errors import LoadError
from backends.runtime_config import RuntimeConfig, RuntimeConfigError

C = TypeVar("C", bound=RuntimeConfig)


class ModelKind(enum.StrEnum):
    LLM = "llm"
    EMBEDDER = "embedder"
    RERANKER = "reranker"


@dataclass(frozen=True)
class BackendContext:
    """What a backend is told about itself when it is created; a kind may extend it with what
    only it reads (`backends.llm.context.LLMContext`)."""

    # Registered model name and version, used as metric labels and in error messages.
    model: str
    version: str
    # The version's runtime config (batch tokens, KV-cache bytes, ...): the kind's typed model
    # (`backends.runtime_config`), or a mapping the backend checks on creation.
    runtime_config: RuntimeConfig | Mapping[str, Any] = field(default_factory=dict)
    # Where the backend registers its Prometheus metrics; None disables them.
    metrics_registry: CollectorRegistry | None = None
    # Safe loading: pickle checkpoints and remote code are refused unless these allow them.
    allow_pickle: bool = False
    trust_remote_code: bool = False
    # Budget of the device the model is placed on, for settings given as a fraction of it.
    device_budget_bytes: int | None = None


class Backend(abc.ABC):
    """One model version on one device. Not thread-safe for lifecycle calls: the manager
    serialises `load`/`offload`/`restore`/`unload` and never calls them with work in flight."""

    kind: ClassVar[ModelKind]

    def __init__(self, context: BackendContext) -> None:
        self.context = context
        self._device: str | None = None

    @property
    def device(self) -> str | None:
        """The device the weights live on now; "cpu" while offloaded, None when unloaded."""
        return self._device

    @classmethod
    @abc.abstractmethod
    def predict_memory(
        cls, artifact_dir: Path, runtime_config: RuntimeConfig | Mapping[str, Any]
    ) -> int:
        """Bytes the model will take on its device once loaded, before loading anything;
        `runtime_config` is the kind's typed config (or a mapping, checked first).

        A backend whose footprint depends on the device (an LLM's KV cache given as a share
        of the budget) may take a keyword `device_budget_bytes: int | None = None`; the
        manager then asks once per candidate device and passes that device's budget. One
        whose footprint differs on a GPU may take a keyword `device: str | None = None`: on
        `cuda:N` it answers what loading allocates there (each tensor as the caching
        allocator rounds it; the CUDA context is charged to the device, not to models)."""

    @abc.abstractmethod
    def load(self, artifact_dir: Path, device: str, dtype: torch.dtype | None = None) -> None:
        """Read the weights from a verified folder and place them on `device`."""

    @abc.abstractmethod
    def memory_bytes(self) -> int:
        """Bytes of parameters, buffers and caches held on the model's device, measured."""

    @abc.abstractmethod
    def offload(self) -> None:
        """Move the weights to host memory and release device memory; work must be idle.

        The manager keeps offloaded backends in its warm tier, so `restore` must bring back
        exactly the model that was offloaded (same outputs). `backends.parking` packs a module
        into one host buffer and restores it with one copy (none onto the CPU)."""

    def offload_bytes(self) -> int:
        """Host bytes `offload()` will hold, asked before offloading so the manager can make
        room in its warm tier. Default: `memory_bytes()`, an upper bound for backends that
        drop caches (a KV cache) on offload; such backends should return the weights alone."""
        return self.memory_bytes()

    @abc.abstractmethod
    def restore(self, device: str) -> None:
        """Bring offloaded weights back onto `device`."""

    @abc.abstractmethod
    def unload(self) -> None:
        """Drop every reference to the weights; later work raises BackendClosedError.

        Models hold reference cycles, so dropping references alone frees nothing until the
        garbage collector runs: empty the tensors first (`backends.parking.release`)."""

    def worker_pids(self) -> list[int]:
        """Processes besides the hub's own that run this model's compute now (an encoder's
        forward workers on a CPU); default: none."""
        return []

    async def aclose(self) -> None:  # noqa: B027 - optional hook, most backends need nothing
        """Stop background workers (queues, threads) before `unload`; default: nothing."""


def checked_config(
    config_type: type[C], runtime_config: RuntimeConfig | Mapping[str, Any], context: str = ""
) -> C:
    """`runtime_config` as `config_type`; LoadError naming the key when it does not check (a
    version registered before configs were checked, or a backend built by hand)."""
    try:
        return config_type.parse(runtime_config)
    except RuntimeConfigError as e:
        raise LoadError(f"{context}: {e}" if context else str(e)) from e
