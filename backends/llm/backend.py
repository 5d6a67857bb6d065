"""The LLM engine behind the `Backend` contract.

The backend owns the tokenizer and one `AsyncLLMEngine` (model runner, KV cache, scheduler,
step thread). Requests come in as text or chat messages, become token ids here, and stream
back as `RequestOutput` deltas; the hub's routes shape them into OpenAI responses.

Memory: `predict_memory` is the weights (from safetensors headers, in the configured dtype)
plus the KV-cache reservation (`kv_cache_bytes`, or `kv_cache_fraction` of the device
budget) plus a small allowance for activations; `memory_bytes` measures parameters, buffers
and the KV-cache tensors. `offload` parks the weights in one host buffer (backends.parking)
and drops the KV cache; `restore` copies them back in one transfer and allocates an empty
cache; `unload` frees the weights in place without waiting for the garbage collector.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from backends.base import Backend, BackendContext, ModelKind
from backends.errors import BackendClosedError, InputError, LoadError
from backends.llm.async_engine import AsyncLLMEngine, RequestStream
from backends.llm.config import EngineConfig, kv_cache_reservation
from backends.llm.engine import LLMEngine, RequestOutput
from backends.llm.metrics import EngineMetrics
from backends.llm.model_runner import ModelRunner
from backends.llm.sampling_params import SamplingParams
from backends.llm.structured.metrics import GrammarMetrics
from backends.loading import (
    module_bytes,
    parse_dtype,
    require_safe_weights,
    tensor_bytes_from_headers,
)
from backends.parking import ParkedWeights, park, release

log = logging.getLogger(__name__)

# Activations of one step (packed hidden states, gathered K/V, logits) on top of weights + KV.
_RUNTIME_OVERHEAD_BYTES = 64 * 2**20


class LLMBackend(Backend):
    kind = ModelKind.LLM

    def __init__(self, context: BackendContext) -> None:
        super().__init__(context)
        self.tokenizer: Any = None
        self._runner: ModelRunner | None = None
        self._engine: AsyncLLMEngine | None = None
        self._metrics = EngineMetrics.disabled()
        self._parked: ParkedWeights | None = None

    @classmethod
    def predict_memory(
        cls,
        artifact_dir: Path,
        runtime_config: Mapping[str, Any],
        *,
        device_budget_bytes: int | None = None,
    ) -> int:
        files = require_safe_weights(artifact_dir)
        dtype = parse_dtype(runtime_config.get("dtype"))
        weights = tensor_bytes_from_headers(files, dtype)
        kv_cache = kv_cache_reservation(runtime_config, device_budget_bytes)
        return weights + kv_cache + _RUNTIME_OVERHEAD_BYTES

    def load(self, artifact_dir: Path, device: str, dtype: torch.dtype | None = None) -> None:
        from transformers import AutoTokenizer

        ctx = self.context
        config = EngineConfig.from_runtime_config(ctx.runtime_config, ctx.device_budget_bytes)
        require_safe_weights(artifact_dir, allow_pickle=ctx.allow_pickle)
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                artifact_dir, local_files_only=True, trust_remote_code=ctx.trust_remote_code
            )
        except Exception as e:
            raise LoadError(f"cannot load the tokenizer in {artifact_dir}: {e}") from e
        runner = ModelRunner.load(
            artifact_dir,
            device,
            dtype,
            config,
            allow_pickle=ctx.allow_pickle,
            trust_remote_code=ctx.trust_remote_code,
        )
        self._metrics = EngineMetrics(ctx.metrics_registry, ctx.model, ctx.version)
        grammar_metrics = GrammarMetrics(ctx.metrics_registry, ctx.model, ctx.version)
        engine = LLMEngine(config, runner, tokenizer, self._metrics, grammar_metrics)
        self.tokenizer = tokenizer
        self._runner = runner
        self._engine = AsyncLLMEngine(engine, name=f"{ctx.model}@{ctx.version}")
        self._device = device
        log.info(
            "%s@%s: %d KV blocks of %d tokens, context %d tokens",
            ctx.model,
            ctx.version,
            runner.num_blocks,
            config.block_size,
            runner.max_model_len,
        )

    # ---- what the routes use ---------------------------------------------------------
    @property
    def engine(self) -> LLMEngine:
        return self._require().engine

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def default_max_tokens(self) -> int:
        return self.engine.config.default_max_tokens

    def encode(self, text: str) -> list[int]:
        self._require()
        ids: list[int] = self.tokenizer.encode(text)
        return ids

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The prompt the tokenizer's chat template makes of `messages` (and `tools`, in
        the template's own way of showing them), ready to answer."""
        self._require()
        if not getattr(self.tokenizer, "chat_template", None):
            raise InputError(
                f"model {self.context.model} has no chat template; use /v1/completions "
                "with a plain prompt instead",
                param="messages",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), tools=tools, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # the template raised (an unknown role, say)
            raise InputError(
                f"the chat template refused the messages: {e}", param="messages"
            ) from e
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def decode(self, token_ids: list[int]) -> str:
        text: str = self.tokenizer.decode(token_ids)
        return text

    async def prepare(self, params: SamplingParams) -> None:
        """Compile the request's grammar, if any, in a worker thread (cached per constraint),
        so the event loop and the engine's step never wait on a compile. InputError (400)
        names what the grammar library does not support."""
        grammars = self._require().engine.grammars
        if params.structured is not None and grammars is not None:
            await asyncio.to_thread(grammars.compile, params.structured)

    def submit(
        self, prompt_token_ids: list[int], params: SamplingParams, *, priority: int = 0
    ) -> RequestStream:
        """Queue one request; raises InputError (400) before anything runs."""
        return self._require().submit(prompt_token_ids, params, priority=priority)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, *, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        async with self.submit(prompt_token_ids, params, priority=priority) as stream:
            async for out in stream:
                yield out

    # ---- lifecycle --------------------------------------------------------------------
    def memory_bytes(self) -> int:
        if self._runner is None or self._parked is not None:
            return 0
        return module_bytes(self._runner.model) + self._runner.kv_cache_bytes()

    def offload_bytes(self) -> int:
        """Host bytes an offload keeps: the weights only (the KV cache is dropped)."""
        return module_bytes(self._require_runner().model)

    def offload(self) -> None:
        runner = self._require_runner()
        if self._parked is not None:
            return
        if self._loaded_engine().engine.has_work():
            raise RuntimeError(f"{self.context.model} has requests in flight; cannot offload")
        runner.release_kv_cache()
        self._parked = park(runner.model)
        self._device = "cpu"
        self._metrics.reset_gauges()
        _release_device_memory()

    def restore(self, device: str) -> None:
        runner = self._require_runner()
        if self._parked is not None:
            self._parked.restore(device)
            self._parked = None
            runner.device = torch.device(device)
        else:
            runner.to(device)
        runner.allocate_kv_cache()
        self._loaded_engine().engine.reset_cache()
        self._device = device

    async def aclose(self) -> None:
        if self._engine is not None:
            await asyncio.to_thread(self._engine.shutdown)

    def unload(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
        if self._parked is not None:
            self._parked.discard()
        elif self._runner is not None:
            self._runner.release_kv_cache()
            release(self._runner.model)  # frees the weights now, cycles in the model or not
        self._parked = None
        self._engine = None
        self._runner = None
        self.tokenizer = None
        self._device = None
        self._metrics.reset_gauges()
        _release_device_memory()

    def _require(self) -> AsyncLLMEngine:
        engine = self._loaded_engine()
        if self._parked is not None:
            raise BackendClosedError(f"LLM {self.context.model} is offloaded; restore it first")
        return engine

    def _loaded_engine(self) -> AsyncLLMEngine:
        if self._engine is None or self._engine.closed:
            raise BackendClosedError(f"LLM {self.context.model} is not loaded")
        return self._engine

    def _require_runner(self) -> ModelRunner:
        if self._runner is None:
            raise BackendClosedError(f"LLM {self.context.model} is not loaded")
        return self._runner


def _release_device_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
