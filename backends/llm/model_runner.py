"""The forward pass: a Hugging Face decoder over the paged KV cache, one packed batch a step.

Contract: `execute(scheduler_output)` runs every scheduled token of every sequence as one
`(1, T)` row with explicit positions, computes logits only at the last token of sequences
that sample, and returns the sampled tokens. The model is the stock transformers class loaded
with our registered attention (`backends.llm.attention`), so no architecture is rewritten;
only the ones verified against transformers' own `generate` are accepted. The runner owns the
KV-cache tensors (per layer, keys and values: `(2, blocks, block_size, kv_heads, head_dim)`)
and knows nothing about requests, text or HTTP. Its `lora` manager holds the LoRA adapters
loaded on the model; a step's tokens run with their sequence's adapter (`seq.adapter`).

A step that verifies speculative drafts (`backends.llm.speculative`) gives each sequence with
drafts a chunk of its last token and its drafts, with logits at each of them: run by the
fused CPU step where it runs, else packed (the static decode path takes no such chunk).

A step of single-token decodes only, without adapters, runs over static buffers padded to a
batch-size bucket (`backends.llm.decode_graphs`): replayed as a captured CUDA graph on a GPU
(`cuda_graphs`), eagerly on a CPU where asked (`static_decode=True`). Its padding rows write
into a scratch block, one block of the cache past the `num_blocks` the block pool hands out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from backends.errors import LoadError
from backends.llm import (
    attention,
    cpu_kernels,
    cpu_linear,
    triton_decode,
    triton_fused,
    triton_prefill,
)
from backends.llm.architectures import unsupported_reason
from backends.llm.attention import (
    AttentionParams,
    PagedAttentionMetadata,
    PrefillChunk,
)
from backends.llm.config import EngineConfig
from backends.llm.fused.start import FusedPath
from backends.llm.fused.step import fused_rows
from backends.llm.int4 import require_int4_kernel
from backends.llm.lora.manager import LoRAManager
from backends.llm.packed_inputs import StepInputs, packed_inputs
from backends.llm.quantization import WeightQuantizer, float32_reference
from backends.llm.sampler import Sampler, SamplerOutput
from backends.llm.scheduler import ScheduledSequence, SchedulerOutput
from backends.llm.speculative.verify import sampling_rows
from backends.llm.static_path import StaticPath
from backends.load_cancel import check_cancelled

log = logging.getLogger(__name__)


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a transformers config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def kv_bytes_per_block(config: Any, block_size: int, dtype: torch.dtype) -> int:
    layers, kv_heads, head_dim = kv_shape(config)
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * kv_heads * block_size * head_dim * element


class ModelRunner:
    def __init__(
        self,
        model: Any,
        engine_config: EngineConfig,
        device: str,
        *,
        batched_decode: bool | None = None,
        native_decode: bool | None = None,
        kernels: cpu_kernels.KernelSettings | None = None,
        static_decode: bool | None = None,
    ) -> None:
        self.model = model
        self.config = model.config
        self.block_size = engine_config.block_size
        self.dtype: torch.dtype = model.dtype
        self.device = torch.device(device)
        per_block = kv_bytes_per_block(self.config, self.block_size, self.dtype)
        self.num_blocks = engine_config.kv_cache_bytes // per_block
        if self.num_blocks < 1:
            raise LoadError(
                f"kv_cache_bytes={engine_config.kv_cache_bytes} holds no KV block of this "
                f"model ({per_block} bytes per block of {self.block_size} tokens); raise it"
            )
        limits = [self.config.max_position_embeddings, self.num_blocks * self.block_size]
        if engine_config.max_model_len is not None:
            limits.append(engine_config.max_model_len)
        self.max_model_len = min(limits)
        self.vocab_size: int = self.config.vocab_size
        _, self.kv_heads, self.head_dim = kv_shape(self.config)
        self.sampler = Sampler(_eos_ids(model))
        # Called as each step's forward starts, just before it releases the GIL (the fused
        # step's native call, or torch's kernels): the async engine hands the previous step's
        # outputs to the event loop there, so that streaming them overlaps the forward.
        self.before_forward: Callable[[], None] | None = None
        # Decodes in one padded call (accelerators) or one call each (CPU); None: by device.
        self.batched_decode = batched_decode
        # The native CPU decode kernel (float32); None: where it builds, False: never.
        self.native_decode = native_decode
        # How that kernel is built (compiler, cache) or whether at all: the hub's settings.
        self.kernels = kernels or cpu_kernels.KernelSettings()
        # Few-row products (decode at a small batch) through the native linear kernel.
        self.native_linear = 0
        if native_decode is not False and self.device.type == "cpu" and self.dtype == torch.float32:
            self.native_linear = cpu_linear.install(model, self.kernels)
        self.kv_caches: list[torch.Tensor] = []
        # Decode-only steps over static buffers, CUDA graphs where on (`static_path`).
        self.graphs = StaticPath(self, engine_config, static_decode)
        # The fused CPU step (backends.llm.fused): started below, forgotten whenever the
        # tensors it points at are about to be replaced.
        self.fused = FusedPath(
            model,
            self._reference_chunk,
            max_context=self.max_model_len,
            max_rows=engine_config.max_num_batched_tokens,
            settings=self.kernels,
        )
        self.allocate_kv_cache()
        self.lora = LoRAManager(
            model,
            self.device,
            self.dtype,
            max_loras=engine_config.max_loras,
            max_rank=engine_config.max_lora_rank,
        )
        if engine_config.fused_step and native_decode is not False:
            self.fused.start(self.kv_caches)
        # Inductor fuses these itself in compile mode (and would trace the kernels' checks).
        self.gpu_fused_ops = 0
        if engine_config.gpu_fused_ops and engine_config.cuda_graph_mode == "capture":
            self.gpu_fused_ops = triton_fused.install(model)
        self.graphs.capture_all()  # at load: counted in its time
        if self.device.type == "cuda":
            # The prefill kernel's first compile (0.7 s on an H200) at load, not in the first
            # request's prefill: its self-check compiles the variant the steps then run.
            heads = self.config.num_attention_heads
            shape = (heads, self.kv_heads, self.head_dim, self.block_size)
            triton_prefill.kernel_for(self.device, self.dtype, shape)

    @classmethod
    def load(
        cls,
        artifact_dir: Path,
        device: str,
        dtype: torch.dtype | None,
        engine_config: EngineConfig,
        *,
        allow_pickle: bool = False,
        trust_remote_code: bool = False,
        batched_decode: bool | None = None,
        native_decode: bool | None = None,
        kernels: cpu_kernels.KernelSettings | None = None,
        static_decode: bool | None = None,
        quantization: str | None = None,
        group_size: int = 128,
    ) -> ModelRunner:
        """The model in `artifact_dir` on `device`; `quantization` "int8" stores its linear
        layers as int8 (`backends.llm.quantization`), "int4" as int4 in groups of
        `group_size` where the kernel takes their shape (`backends.llm.int4`), None keeps the
        checkpoint's weights."""
        from transformers import AutoConfig

        from backends.loading import load_causal_lm

        try:
            config = AutoConfig.from_pretrained(
                artifact_dir, local_files_only=True, trust_remote_code=trust_remote_code
            )
        except Exception as e:
            raise LoadError(f"cannot read the model config in {artifact_dir}: {e}") from e
        reason = unsupported_reason(config.to_dict())
        if reason is not None:
            raise LoadError(reason)
        attention.register()
        if quantization not in (None, "int8", "int4"):
            raise LoadError(f"quantization {quantization!r} is not supported; use int8 or int4")
        if quantization == "int4":
            require_int4_kernel(device)
        # Quantized tensor by tensor as the checkpoint is read: the load's peak is near the
        # quantized size, not the float one.
        quantizer = None
        if quantization is not None:
            quantizer = WeightQuantizer(quantization, group_size)
        try:
            # Weights go straight from the safetensors files onto the device (no random init
            # of parameters about to be overwritten, no copy into preallocated ones).
            model: Any = load_causal_lm(
                artifact_dir,
                device,
                dtype,
                trust_remote_code=trust_remote_code,
                attn_implementation=attention.ATTENTION_NAME,
                transform=quantizer,
            )
        except LoadError:
            raise
        except Exception as e:
            raise LoadError(f"cannot load the model in {artifact_dir}: {e}") from e
        if quantizer is not None:
            layers = quantizer.layer_count(model)
            log.info("%s: %d linear layers quantized (%s)", artifact_dir, layers, quantization)
        return cls(
            model,
            engine_config,
            device,
            batched_decode=batched_decode,
            native_decode=native_decode,
            kernels=kernels,
            static_decode=static_decode,
        )

    # ---- memory -----------------------------------------------------------------------
    def allocate_kv_cache(self) -> None:
        """A cache of `num_blocks` blocks, plus the scratch block where static decode steps
        can run, in one allocation (each layer's tensor a view of it); graphs over the old
        cache are dropped (captured again when needed). Its contents are left as they come
        (no fill) where every decode attends each row only up to its length; zeros where the
        padded torch call may run (`_reads_past_lengths`)."""
        layers, kv_heads, head_dim = kv_shape(self.config)
        scratch = self.graphs.scratch_blocks()
        shape = (layers, 2, self.num_blocks + scratch, self.block_size, kv_heads, head_dim)
        self.kv_caches = []
        self.fused.forget()  # it points at the old tensors; rebuilt at the next step
        self.graphs.forget()
        check_cancelled()  # a load that ran out of time stops before allocating
        make = torch.zeros if self._reads_past_lengths() else torch.empty
        self.kv_caches = list(make(shape, dtype=self.dtype, device=self.device).unbind(0))

    def _reads_past_lengths(self) -> bool:
        """Whether a decode step may run the padded torch attention (`_decode_batched`): it
        reads every slot of a row's padded table and masks the scores, and a masked slot
        holding NaN still poisons the row (0 * NaN), so the cache must start finite. The
        Triton kernel, the native CPU kernel, the fused step and the per-row torch path
        read each context only up to its length, and a slot is written before it is read
        (prefill chunks attend to positions their own step or an earlier one wrote)."""
        if triton_decode.kernel_for(self.device) is not None:
            return False
        batched = self.batched_decode
        if batched is None:
            batched = self.device.type != "cpu"
        return batched or self.graphs.wanted

    def release_kv_cache(self) -> None:
        self.kv_caches = []
        self.fused.forget()
        self.graphs.forget()

    def kv_cache_bytes(self) -> int:
        return sum(kv.nbytes for kv in self.kv_caches)

    def to(self, device: str) -> None:
        """Move the weights (and any KV cache, reallocated empty) to `device`."""
        self.device = torch.device(device)
        self.fused.forget()
        self.graphs.forget()
        self.model.to(self.device)
        self.lora.move_to(self.device)
        if self.kv_caches:
            self.allocate_kv_cache()

    def graph_bytes(self) -> int:
        """Device bytes of the static decode step: its buffers and its graphs' memory pool."""
        return self.graphs.bytes()

    # ---- one step -----------------------------------------------------------------------
    def execute(self, output: SchedulerOutput) -> SamplerOutput:
        self.sampler.forget(output.finished_seq_ids)
        if output.is_empty:
            return SamplerOutput([], [])
        fused = self.fused.decoder_for(output, self.kv_caches)
        if fused is None:
            with torch.inference_mode():
                return self._execute_unfused(output)
        # The rows agree by construction (no `check`); the kernel refuses any index out of
        # range itself.
        step = fused_rows(output.scheduled, self.block_size)
        sampling = sampling_rows(output.scheduled)
        if self.sampler.greedy_only(sampling):
            # Argmax only: the step makes no tensor and runs no torch op at all.
            tokens = fused.greedy(step, before=self.before_forward)
            return SamplerOutput(tokens, [None] * len(tokens))
        with torch.inference_mode():
            self.sampler.prepare(sampling)  # grammar masks fill during the forward
            logits = fused(step, checked=True, before=self.before_forward)
            return self.sampler(logits, sampling)

    def _execute_unfused(self, output: SchedulerOutput) -> SamplerOutput:
        """The step through the static decode path or the transformers modules."""
        if any(item.drafts for item in output.scheduled):
            return self._execute_packed(output)
        static = self.graphs.for_step(output)
        if static is not None:
            sampling = [item.seq for item in output.scheduled if item.sample]
            self.sampler.prepare(sampling)
            logits = static.run(output.scheduled, self.before_forward)
            rows: list[int] | None = None
            if len(sampling) < len(output.scheduled):
                rows = [i for i, item in enumerate(output.scheduled) if item.sample]
            return self.sampler(logits, sampling, rows)
        return self._execute_packed(output)

    @torch.inference_mode()
    def fused_logits(self, output: SchedulerOutput) -> torch.Tensor | None:
        """The logits (S, V) of the sampling rows of `output` (one per sampling entry, no
        drafts) through the fused step, sampling nothing: for a caller that picks its tokens
        itself (a draft model's greedy drafts). None where the step would not run fused
        (then `execute` it)."""
        if output.is_empty or any(item.drafts for item in output.scheduled):
            return None
        fused = self.fused.decoder_for(output, self.kv_caches)
        if fused is None:
            return None
        return fused(fused_rows(output.scheduled, self.block_size), checked=True)

    def _execute_packed(self, output: SchedulerOutput) -> SamplerOutput:
        """The step through the transformers modules, every token in one packed row."""
        inputs = self._prepare(output)
        self.sampler.prepare(inputs.sampling_seqs)  # grammar masks fill during the forward
        self.lora.begin_step(inputs.adapter_segments)
        self._forward_starts()
        try:
            logits = self.model(
                input_ids=inputs.input_ids,
                position_ids=inputs.positions,
                logits_to_keep=inputs.logits_indices,
                use_cache=False,
                paged_metadata=inputs.metadata,
            ).logits[0]  # (S, V)
        finally:
            self.lora.end_step()
        return self.sampler(logits, inputs.sampling_seqs)

    def _forward_starts(self) -> None:
        if self.before_forward is not None:
            self.before_forward()

    # ---- isolation: which request broke a step (backends.llm.isolation) ----------------
    @torch.inference_mode()
    def check_sequence(self, item: ScheduledSequence) -> None:
        """Prepare `item` alone as a step would: its inputs, then sampling of a dummy row by a
        throwaway sampler (the real one's seeded generators stay as they are). Raises what
        that raises; runs no model and changes no state."""
        self._prepare(SchedulerOutput([item], item.num_tokens))
        if self.fused.decoder is not None:
            self.fused.decoder.check(fused_rows([item], self.block_size))
        if item.sample:
            probe = type(self.sampler)(self.sampler.eos_token_ids)
            probe(torch.zeros(1, self.vocab_size, device=self.device), [item.seq])

    @torch.inference_mode()
    def _reference_chunk(
        self,
        tokens: list[int],
        slots: list[int],
        blocks: list[int],
        recorded: dict[int, AttentionParams],
    ) -> torch.Tensor:
        """The transformers path on one chunk at positions 0.. (the fused step's check)."""
        n = len(tokens)
        metadata = PagedAttentionMetadata(
            kv_caches=self.kv_caches,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            prefills=[PrefillChunk(0, n, 0, torch.tensor(blocks, dtype=torch.long))],
            recorded=recorded,
        )
        with float32_reference():  # int8 layers as their exact float32 products
            logits: torch.Tensor = self.model(
                input_ids=torch.tensor([tokens], dtype=torch.long, device=self.device),
                position_ids=torch.arange(n, device=self.device)[None],
                logits_to_keep=torch.arange(n, device=self.device),
                use_cache=False,
                paged_metadata=metadata,
            ).logits[0]
        return logits

    def _prepare(self, output: SchedulerOutput) -> StepInputs:
        return packed_inputs(self, output)

    def _native_kernel(self) -> cpu_kernels.PagedDecodeKernel | None:
        if self.native_decode is False:
            return None
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return None
        return cpu_kernels.paged_decode(self.kernels)


def _eos_ids(model: Any) -> list[int]:
    ids: set[int] = set()
    for source in (model.generation_config, model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return sorted(ids)
