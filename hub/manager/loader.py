"""Turns a model version into a loaded backend: look up, materialise, construct, load."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from backends.base import Backend, BackendContext, ModelKind, checked_config
from backends.errors import LoadError
from backends.kinds import backend_class
from backends.llm.context import LLMContext
from backends.llm.kernel_settings import KernelSettings
from backends.llm.structured.pool import CompilePool
from backends.loading import parse_dtype
from backends.runtime_config import RuntimeConfig, config_type
from hub.manager.state import ModelKey
from registry.service import Registry
from registry.views import VersionView


@dataclass(frozen=True)
class PreparedVersion:
    """A version whose files are verified locally, ready to be loaded onto a device."""

    view: VersionView
    artifact_dir: Path
    backend_cls: type[Backend]
    # The version's runtime config, checked and typed for its kind.
    config: RuntimeConfig
    # A LoRA adapter's base version: it is attached to that model's backend, not loaded.
    base: ModelKey | None = None
    # The local folder of an LLM's `speculative.draft` model, loaded inside its backend.
    draft_dir: Path | None = None

    def predict_memory(
        self, device_budget_bytes: int | None = None, device: str | None = None
    ) -> int:
        """The backend's prediction; `device_budget_bytes` reaches backends whose footprint
        depends on the device (an LLM's KV cache as a share of the budget) and `device`
        those that predict a GPU apart, when their `predict_memory` takes them; each is
        left out for those that do not."""
        predict = self.backend_cls.predict_memory
        kwargs: dict[str, Any] = {}
        if device_budget_bytes is not None and takes_device_budget(self.backend_cls):
            kwargs["device_budget_bytes"] = device_budget_bytes
        if device is not None and takes_device(self.backend_cls):
            kwargs["device"] = device
        total = predict(self.artifact_dir, self.config, **kwargs)
        if self.draft_dir is not None:  # the draft is charged with its target
            total += predict(self.draft_dir, self.config, **kwargs)
        return total


@functools.cache
def takes_device_budget(backend_cls: type[Backend]) -> bool:
    """Whether `backend_cls.predict_memory` accepts `device_budget_bytes` (optional in the
    Backend contract)."""
    return "device_budget_bytes" in inspect.signature(backend_cls.predict_memory).parameters


@functools.cache
def takes_device(backend_cls: type[Backend]) -> bool:
    """Whether `backend_cls.predict_memory` accepts `device` (optional in the contract)."""
    return "device" in inspect.signature(backend_cls.predict_memory).parameters


class VersionLoader:
    """Blocking steps of a load; the manager runs them in a worker thread."""

    def __init__(
        self,
        registry: Registry,
        *,
        metrics_registry: CollectorRegistry | None = None,
        allow_pickle: bool = False,
        trust_remote_code: bool = False,
        kernels: KernelSettings | None = None,
        grammar_pool: CompilePool | None = None,
        max_queue_time_ms: float | None = None,
    ) -> None:
        self.registry = registry
        # The hub's `max_queue_time_ms`: that of every version whose config leaves it out.
        self.max_queue_time_ms = max_queue_time_ms
        # The LLM engine's native kernels, as the hub's `engine:` settings say.
        self.kernels = kernels or KernelSettings()
        # Where the LLMs' grammars compile (one pool for all); None: each LLM its own.
        self.grammar_pool = grammar_pool
        self.metrics_registry = metrics_registry
        self.allow_pickle = allow_pickle
        self.trust_remote_code = trust_remote_code

    def prepare(self, key: ModelKey) -> PreparedVersion:
        view = self.registry.get_version(key.name, key.version)
        # A version registered before configs were checked may hold a bad one: LoadError
        # naming the key, before any file is copied.
        config = checked_config(
            config_type(view.kind), view.runtime_config, f"{view.name} v{view.version}"
        )
        config = with_queue_time(config, self.max_queue_time_ms)
        artifact_dir = self.registry.materialise(view)
        if view.base is not None:
            from hub.adapters.binding import AdapterBackend

            base = ModelKey(view.base.name, view.base.version)
            return PreparedVersion(view, artifact_dir, AdapterBackend, config, base)
        draft = getattr(config, "speculative", None)
        draft_dir = self._draft_dir(draft.draft) if draft and draft.draft else None
        return PreparedVersion(
            view, artifact_dir, backend_class(view.kind), config, None, draft_dir
        )

    def _draft_dir(self, reference: str) -> Path:
        """The verified folder of the registered LLM `reference` (`name@version-or-alias`)
        names; LoadError naming the reference when it names none."""
        from registry.adapters import resolve_base
        from registry.errors import InvalidSourceError

        try:
            ref = resolve_base(reference, self.registry.get_model)
        except InvalidSourceError as e:
            raise LoadError(f"speculative.draft {reference!r}: {e}") from e
        return self.registry.materialise(self.registry.get_version(ref.name, ref.version))

    def attach(self, prepared: PreparedVersion, base: Backend) -> Backend:
        """Attach a LoRA adapter version to its loaded base's backend (milliseconds: the
        base is neither reloaded nor copied)."""
        from backends.llm.backend import LLMBackend
        from hub.adapters.binding import AdapterBackend

        if not isinstance(base, LLMBackend):
            raise TypeError(f"{prepared.base} is a {base.kind}, not an llm: no adapter runs on it")
        return AdapterBackend.attach(
            base, _adapter_key(prepared.view), prepared.artifact_dir, self._context(prepared)
        )

    def load(
        self, prepared: PreparedVersion, device: str, device_budget: int | None = None
    ) -> Backend:
        backend = prepared.backend_cls(self._context(prepared, device_budget))
        backend.load(prepared.artifact_dir, device, parse_dtype(prepared.config.dtype))
        return backend

    def _context(
        self, prepared: PreparedVersion, device_budget: int | None = None
    ) -> BackendContext:
        view = prepared.view
        context = BackendContext(
            model=view.name,
            version=str(view.version),
            runtime_config=prepared.config,
            metrics_registry=self.metrics_registry,
            allow_pickle=self.allow_pickle,
            trust_remote_code=self.trust_remote_code,
            device_budget_bytes=device_budget,
        )
        if prepared.backend_cls.kind is ModelKind.LLM:  # only the LLM engine builds kernels
            return LLMContext.of(context, self.kernels, self.grammar_pool, prepared.draft_dir)
        return context


def with_queue_time(config: RuntimeConfig, max_queue_time_ms: float | None) -> RuntimeConfig:
    """`config` with the hub's `max_queue_time_ms` where its kind has the key and the
    version's config leaves it out (a version that sets it, even to null, keeps its own)."""
    if (
        max_queue_time_ms is None
        or "max_queue_time_ms" not in type(config).model_fields
        or "max_queue_time_ms" in config.model_fields_set
    ):
        return config
    return config.model_copy(update={"max_queue_time_ms": max_queue_time_ms})


def _adapter_key(view: VersionView) -> str:
    """The adapter's name in its base's engine: unique per version (`name@version`)."""
    return f"{view.name}@{view.version}"
