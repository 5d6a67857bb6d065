"""A LoRA adapter version as a backend: the base's LLM backend seen through one adapter.

The manager keeps one entry per adapter version, and that entry's backend is an
`AdapterBackend`: requests served through it run on the base's engine with the adapter
named on every generation, while everything else a route reads (tokenizer, chat template,
config, engine) is the base's. Its lifecycle is the adapter's alone and never touches the
base's weights: `attach` registers the adapter with the base's engine (the engine reads its
tensors into host memory and copies them into a device slot on demand), `unload` removes it
from the engine. `offload` frees its device slot and keeps the engine's host copy (the
adapter's warm tier), `restore` copies that back into a slot, registering the adapter anew
only if the engine no longer has it. The base's own `offload`/`unload` are the manager's
business, done on the base's entry after its adapters' entries have left (`hub.manager`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from backends.base import BackendContext
from backends.errors import BackendClosedError, LoadError
from backends.llm.async_engine import RequestStream
from backends.llm.backend import LLMBackend
from backends.llm.engine import RequestOutput
from backends.llm.sampling_params import SamplingParams
from backends.runtime_config import RuntimeConfig


class AdapterBackend(LLMBackend):
    """One adapter version on its loaded base. Contract: `submit` and `generate` run on the
    base's engine with `adapter=key`; other attributes and methods are the base's (read
    through it, never copied); `memory_bytes`/`offload_bytes` are the adapter's bytes; the
    lifecycle calls act on the adapter only. Built by `attach`, never by `load`."""

    def __init__(
        self, base: LLMBackend, key: str, adapter_dir: Path, context: BackendContext
    ) -> None:
        # No LLMBackend.__init__: tokenizer, engine and config are the base's (`__getattr__`).
        self.context = context
        self.base = base
        self.key = key
        self.adapter_dir = adapter_dir
        self.nbytes = 0
        self._servable = False

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this view does not set: the base's state.
        base = self.__dict__.get("base")
        if base is None:
            raise AttributeError(name)
        return getattr(base, name)

    @classmethod
    def attach(
        cls, base: LLMBackend, key: str, adapter_dir: Path, context: BackendContext
    ) -> AdapterBackend:
        """Register the adapter in `adapter_dir` with the loaded `base` under `key` (blocking,
        milliseconds for a small adapter: the base is neither reloaded nor copied)."""
        view = cls(base, key, adapter_dir, context)
        view.restore(base.device or "cpu")
        return view

    @classmethod
    def predict_memory(
        cls,
        artifact_dir: Path,
        runtime_config: RuntimeConfig | Mapping[str, Any],
        *,
        device_budget_bytes: int | None = None,
        device: str | None = None,
    ) -> int:
        """What the adapter costs on its base's device (its slot), read from its files."""
        from backends.llm.lora import adapter_bytes, read_adapter

        return adapter_bytes(read_adapter(artifact_dir))

    # ---- what the routes use ---------------------------------------------------------
    @property
    def device(self) -> str | None:
        return self.base.device if self._servable else None

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        adapter: str | None = None,
    ) -> RequestStream:
        self._require_servable()
        return self.base.submit(prompt_token_ids, params, priority=priority, adapter=self.key)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        adapter: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        await self.compile_grammar(params)  # on the grammar pool, not in `submit`'s thread
        async with self.submit(prompt_token_ids, params, priority=priority) as stream:
            async for out in stream:
                yield out

    # ---- lifecycle: the adapter's, never the base's --------------------------------------
    def load(self, artifact_dir: Path, device: str, dtype: Any = None) -> None:
        raise LoadError(f"{self.key} is a LoRA adapter: it is attached to its base, not loaded")

    def memory_bytes(self) -> int:
        return self.nbytes if self._servable else 0

    def offload_bytes(self) -> int:
        return self.nbytes

    def offload(self) -> None:
        self._servable = False
        if self.key in self.base.loaded_adapters():
            self.base.offload_adapter(self.key)  # the slot goes; the host copy stays

    def restore(self, device: str) -> None:
        if self.key in self.base.loaded_adapters():
            self.base.restore_adapter(self.key)
        else:
            self.nbytes = self.base.load_adapter(self.key, self.adapter_dir)
        self._servable = True

    async def aclose(self) -> None:
        self._servable = False

    def unload(self) -> None:
        self._servable = False
        # The base may be gone already (its unload took the engine's adapters with it).
        if self.base.device is not None and self.key in self.base.loaded_adapters():
            self.base.unload_adapter(self.key)

    def _require_servable(self) -> None:
        if not self._servable:
            raise BackendClosedError(f"adapter {self.key} is not loaded on its base")
