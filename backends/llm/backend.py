"""The LLM engine behind the `Backend` contract.

The backend owns the tokenizer and one `AsyncLLMEngine` (model runner, KV cache, scheduler,
step thread). Requests come in as text or chat messages, become token ids here, and stream
back as `RequestOutput` deltas; the hub's routes shape them into OpenAI responses.

Memory: `predict_memory` is the weights (from safetensors headers, in the configured dtype,
int8 or int4 where the runtime config asks `quantization`) plus the KV-cache reservation
(`kv_cache_bytes`, or `kv_cache_fraction` of the device budget) plus a small allowance for
activations; `memory_bytes` measures parameters, buffers and the KV-cache tensors.
`offload` parks the weights in one host buffer (backends.parking) and drops the KV cache;
`restore` copies them back in one transfer and allocates a new cache, keeping the engine,
tokenizer and block pool; `unload` frees the weights in place without waiting for the
garbage collector.

LoRA adapters (backends.llm.lora): `load_adapter(key, folder)` checks a PEFT adapter against
the loaded base and keeps its weights in host memory, ready for requests that name `key`
(`submit(..., adapter=key)`); the base is neither reloaded nor copied, and one step mixes
the base and any adapters. Adapters take turns in `max_loras` device slots (least recently
used out); an offload drops the slots, which refill on demand, and `offload_adapter` /
`restore_adapter` move one adapter out of its slot (its host copy stays) and back.
`unload_adapter` waits a few seconds for the adapter's requests in flight to end (an aborted
one leaves at the next step), then refuses (`AdapterInUseError`, a retry-later error).
These methods block; call them from a worker thread.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

from backends.admission import device_work
from backends.base import Backend, BackendContext, ModelKind, checked_config
from backends.errors import (
    BackendClosedError,
    CapacityError,
    ContextLengthError,
    InputError,
    LoadError,
)
from backends.llm.async_engine import AsyncLLMEngine, RequestStream
from backends.llm.config import EngineConfig
from backends.llm.context import draft_dir, grammar_pool, kernel_settings
from backends.llm.detokenizer import token_bytes
from backends.llm.engine import LLMEngine, RequestOutput
from backends.llm.footprint import predict_llm_memory
from backends.llm.lora.adapter import check_adapter_fits, read_adapter
from backends.llm.metrics import EngineMetrics
from backends.llm.model_runner import ModelRunner
from backends.llm.sampling_params import SamplingParams
from backends.llm.speculative.resident import ResidentDraft, load_draft
from backends.llm.structured.limits import GrammarLimits
from backends.llm.structured.metrics import GrammarMetrics
from backends.llm.structured.pool import CompilePool
from backends.loading import (
    module_bytes,
    require_safe_weights,
)
from backends.parking import ParkedWeights, park, release
from backends.runtime_config import LLMConfig, RuntimeConfig
from backends.text_bounds import MIN_CHARS_PER_TOKEN, CharBound
from backends.text_input import require_encodable
from backends.threads import compute_threads
from backends.workers import on_own_thread

log = logging.getLogger(__name__)

T = TypeVar("T")

# Requests of at most this many bytes are tokenized on the event loop: their prompts (a chat
# template's text included) encode in well under a millisecond, and a result handed back from
# the tokenizer thread waits for its turn behind everything else on the loop, which under a
# burst is every other request's handling. Longer ones go to the thread: the loop never
# blocks on a long encode.
INLINE_TOKENIZE_BYTES = 1024


class LLMBackend(Backend):
    kind = ModelKind.LLM

    def __init__(self, context: BackendContext) -> None:
        super().__init__(context)
        where = f"{context.model} v{context.version}"
        self.config: LLMConfig = checked_config(LLMConfig, context.runtime_config, where)
        self.tokenizer: Any = None
        self._prompt_bound = CharBound(0, MIN_CHARS_PER_TOKEN)  # set by load()
        self._runner: ModelRunner | None = None
        # A `speculative.draft` model, loaded, charged and moved with this one.
        self._draft: ResidentDraft | None = None
        self._engine: AsyncLLMEngine | None = None
        self._metrics = EngineMetrics.disabled()
        self._parked: ParkedWeights | None = None
        self._artifact_dir = Path()
        # One thread tokenizes this model's longer prompts, in arrival order: a long one takes
        # seconds, which the event loop (health probes, every other request) must not wait.
        self._tokenize_pool: ThreadPoolExecutor | None = None
        # Grammars compile on the hub's pool, else on one this backend makes when first needed.
        self._grammar_pool = grammar_pool(context)
        self._grammar_limits = GrammarLimits.of(self.config)

    @classmethod
    def predict_memory(
        cls,
        artifact_dir: Path,
        runtime_config: RuntimeConfig | Mapping[str, Any],
        *,
        device_budget_bytes: int | None = None,
        device: str | None = None,
    ) -> int:
        """Weights, KV cache and one step's activations; on a CUDA `device` each weight is
        counted as the caching allocator rounds it and the CPU's fused scratch is left out."""
        return predict_llm_memory(
            artifact_dir, runtime_config, device_budget_bytes=device_budget_bytes, device=device
        )

    def load(self, artifact_dir: Path, device: str, dtype: torch.dtype | None = None) -> None:
        from transformers import AutoTokenizer

        ctx = self.context
        config = EngineConfig.from_runtime_config(self.config, ctx.device_budget_bytes)
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
            kernels=kernel_settings(ctx),
            quantization=self.config.quantization_method(),
            group_size=self.config.quantization_group_size,
        )
        spec = config.speculative
        if spec is not None and spec.draft is not None:
            try:
                self._draft = load_draft(
                    draft_dir(ctx), spec.draft, tokenizer, runner, config, device, dtype,
                    kernels=kernel_settings(ctx),
                )  # fmt: skip
            except Exception:
                runner.release_kv_cache()
                release(runner.model)  # the target goes too: no half-loaded model
                raise
        self._metrics = EngineMetrics(ctx.metrics_registry, ctx.model, ctx.version)
        grammar_metrics = GrammarMetrics(ctx.metrics_registry, ctx.model, ctx.version)
        proposer = self._draft.draft if self._draft is not None else None
        engine = LLMEngine(config, runner, tokenizer, self._metrics, grammar_metrics, proposer)
        self.tokenizer = tokenizer
        self._artifact_dir = artifact_dir
        # Prompts longer than this many characters cannot fit the context: refused before
        # tokenizing (added tokens included: a special token's text is one token too).
        self._prompt_bound = CharBound.for_vocab(runner.max_model_len, tokenizer.get_vocab())
        self._runner = runner
        # On a CPU the step thread runs torch on the compute threads the process chose
        # (`hub serve`: every core, while other threads start at one: backends/threads.py).
        self._engine = AsyncLLMEngine(
            engine,
            name=f"{ctx.model}@{ctx.version}",
            threads=compute_threads() if device.startswith("cpu") else None,
        )
        self._tokenize_pool = ThreadPoolExecutor(1, f"tokenize {ctx.model}@{ctx.version}")
        self._device = device
        # Its outstanding work counts in the device's, as the encoders' does: each model's
        # admission sees what the others on the device have to do.
        engine.work.count_on(device_work(device))
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

    def encode(self, text: str, *, param: str = "prompt") -> list[int]:
        self._require()
        self._prompt_bound.require(text, param, param, error=ContextLengthError)
        require_encodable(text, param)
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
        for message in messages:
            require_encodable(list(message.values()), "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), tools=tools, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # the template raised (an unknown role, say)
            raise InputError(
                f"the chat template refused the messages: {e}", param="messages"
            ) from e
        self._prompt_bound.require(
            text, "messages", "the prompt the messages make", error=ContextLengthError
        )
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    async def tokenize(self, build: Callable[[], T], *, size: int | None = None) -> T:
        """Run `build` (which tokenizes a request's prompts with `encode` / `encode_chat`) and
        return its result: on the event loop when `size` (the request's bytes, which bound
        the text it tokenizes) is at most INLINE_TOKENIZE_BYTES, else (or None: unknown) on
        this model's tokenizer thread, so the loop never waits for a long encode. The same
        ids either way. CapacityError (503) first when the work on the model's device is
        over its bound: a refused request costs no tokenizing (EngineWork.reserve)."""
        pool = self._tokenize_pool
        if pool is None:
            raise BackendClosedError(f"LLM {self.context.model} is not loaded")
        engine = self._require().engine
        try:
            engine.work.reserve()
        except CapacityError:
            engine.metrics.observe_shed("queue_time")
            raise
        try:
            if size is not None and size <= INLINE_TOKENIZE_BYTES:
                return build()
            context = contextvars.copy_context()
            return await asyncio.get_running_loop().run_in_executor(pool, context.run, build)
        finally:
            engine.work.unreserve()

    def decode(self, token_ids: list[int]) -> str:
        text: str = self.tokenizer.decode(token_ids)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes, part of a character for a byte token (logprobs `bytes`)."""
        return token_bytes(self.tokenizer, token_id)

    async def compile_grammar(self, params: SamplingParams, *, caller: str = "anonymous") -> None:
        """Compile the request's grammar, if any and not cached, on the grammar pool (never
        the event loop's default executor), as one of `caller`'s compiles. InputError (400)
        names a limit the constraint is over or what the grammar library does not support;
        CapacityError (503) when `caller` has too many compiles or the time limit passed.
        Cancelling the await drops a compile that has not started."""
        grammars = self._require().engine.grammars
        spec = params.structured
        if spec is None or grammars is None:
            return
        self._grammar_limits.check(spec)
        if grammars.cached(spec):
            return
        if self._grammar_pool is None:
            self._grammar_pool = CompilePool()
        compile_spec = functools.partial(grammars.compile, spec, count_hit=False)
        limit_s = self._grammar_limits.compile_timeout_s
        await self._grammar_pool.run((grammars, spec), compile_spec, caller=caller, limit_s=limit_s)

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        adapter: str | None = None,
    ) -> RequestStream:
        """Queue one request, with the LoRA adapter loaded as `adapter` (None: the base);
        raises InputError (400) before anything runs, for an unknown adapter too."""
        return self._require().submit(prompt_token_ids, params, priority=priority, adapter=adapter)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        adapter: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        await self.compile_grammar(params)  # on the grammar pool, not in `submit`'s thread
        stream = self.submit(prompt_token_ids, params, priority=priority, adapter=adapter)
        async with stream:
            async for out in stream:
                yield out

    # ---- LoRA adapters (blocking: call from a worker thread) --------------------------
    def load_adapter(self, key: str, adapter_dir: Path) -> int:
        """Check the PEFT adapter in `adapter_dir` against this base and make it usable by
        requests naming `key` (a key already loaded is replaced); returns its device bytes
        (slot plus batched copy, in the base's dtype). AdapterError (400) names what does
        not fit; AdapterInUseError while a replaced key still serves."""
        runner = self._require_runner()
        spec = read_adapter(adapter_dir)  # the rank is checked against max_lora_rank below
        check_adapter_fits(spec, self._artifact_dir)
        nbytes = runner.lora.add(key, spec)
        log.info("%s: adapter %s loaded (%d bytes)", self.context.model, key, nbytes)
        return nbytes

    def unload_adapter(self, key: str, *, wait_s: float = 5.0) -> None:
        """Free `key`'s host copy and device slot. Waits up to `wait_s` for its requests in
        flight to end (aborted ones leave at the next step), then refuses with
        AdapterInUseError (503, retry later)."""
        self._require_runner().lora.remove(key, wait_s)

    def offload_adapter(self, key: str) -> None:
        """Free `key`'s device slot now; its host copy stays and it remains usable (its next
        request, or `restore_adapter`, copies it back into a slot)."""
        lora = self._require_runner().lora
        lora.peek(key)  # InputError for an adapter that is not loaded
        lora.evict(key)

    def restore_adapter(self, key: str) -> None:
        """Copy `key` from host memory into a device slot now (the least recently used
        adapter's slot when all are taken), as its next request would."""
        lora = self._require_runner().lora
        lora.peek(key)
        lora.ensure_resident([key])

    def loaded_adapters(self) -> dict[str, int]:
        """Loaded adapter keys and their device bytes."""
        if self._runner is None:
            return {}
        return self._runner.lora.loaded()

    # ---- lifecycle --------------------------------------------------------------------
    def memory_bytes(self) -> int:
        if self._runner is None or self._parked is not None:
            return 0
        runner = self._runner
        fused = runner.fused.scratch_bytes
        draft = self._draft.memory_bytes() if self._draft is not None else 0
        weights = module_bytes(runner.model)
        return weights + runner.kv_cache_bytes() + fused + runner.graph_bytes() + draft

    def offload_bytes(self) -> int:
        """Host bytes an offload keeps: the weights only (the KV cache is dropped)."""
        draft = self._draft.offload_bytes() if self._draft is not None else 0
        return module_bytes(self._require_runner().model) + draft

    def offload(self) -> None:
        runner = self._require_runner()
        if self._parked is not None:
            return
        if self._loaded_engine().engine.has_work():
            raise RuntimeError(f"{self.context.model} has requests in flight; cannot offload")
        runner.release_kv_cache()
        runner.lora.move_to(torch.device("cpu"))  # adapter slots refill on demand
        self._parked = park(runner.model)
        if self._draft is not None:
            self._draft.offload()
        self._device = "cpu"
        self._loaded_engine().engine.work.count_on(None)
        self._metrics.reset_gauges()
        _release_device_memory()

    def restore(self, device: str) -> None:
        """The parked weights back in one copy (none onto the CPU) and a new KV cache; the
        engine, scheduler, block pool, tokenizer and sampler are the ones from the load.
        What points at tensor addresses (the fused CPU step, decode graphs) is rebuilt at
        the first step that needs it."""
        runner = self._require_runner()
        if self._parked is not None:
            self._parked.restore(device)
            self._parked = None
            runner.device = torch.device(device)
            runner.lora.move_to(runner.device)
        else:
            runner.to(device)  # a cache it holds comes along, allocated anew
        if not runner.kv_caches:
            runner.allocate_kv_cache()
        if self._draft is not None:
            self._draft.restore(device)
        self._loaded_engine().engine.cache_replaced()
        self._device = device
        self._loaded_engine().engine.work.count_on(device_work(device))

    async def aclose(self) -> None:
        if self._engine is not None:
            # A thread of its own (backends/workers.py): an eviction never waits behind a pool.
            await on_own_thread(self._engine.shutdown, name="engine-close")

    def unload(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine.engine.work.count_on(None)
        if self._tokenize_pool is not None:
            # A prompt still tokenizing finishes on its own; nobody waits for it.
            self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
            self._tokenize_pool = None
        if self._grammar_pool is not None and grammar_pool(self.context) is None:
            self._grammar_pool.close()  # this backend's own: queued compiles are dropped
            self._grammar_pool = None
        if self._parked is not None:
            self._parked.discard()
        elif self._runner is not None:
            self._runner.release_kv_cache()
            release(self._runner.model)  # frees the weights now, cycles in the model or not
        if self._draft is not None:
            self._draft.unload()
        self._draft = None
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
