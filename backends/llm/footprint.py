"""What an LLM will hold once loaded, predicted from its files before the load: weights (as
the load stores them: dtype, quantization, a CUDA allocator's rounding), the KV cache
reservation, one step's activations and, where the fused CPU step may run, its scratch."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from backends.llm.config import kv_cache_reservation, llm_config
from backends.llm.fused.decoder import predicted_scratch_bytes
from backends.llm.model_runner import kv_bytes_per_block
from backends.llm.quantization import WeightQuantizer
from backends.loading import (
    HeaderTensor,
    header_tensors,
    parse_dtype,
    require_safe_weights,
    tensor_bytes,
)
from backends.runtime_config import LLMConfig, RuntimeConfig
from backends.threads import cores

# Activations of one step (packed hidden states, gathered K/V, logits) on top of weights + KV.
_RUNTIME_OVERHEAD_BYTES = 64 * 2**20


def predict_llm_memory(
    artifact_dir: Path,
    runtime_config: RuntimeConfig | Mapping[str, Any],
    *,
    device_budget_bytes: int | None = None,
    device: str | None = None,
) -> int:
    """Weights, KV cache and one step's activations; on a CUDA `device` each weight is
    counted as the caching allocator rounds it and the CPU's fused scratch is left out."""
    config = llm_config(runtime_config)
    files = require_safe_weights(artifact_dir)
    dtype = parse_dtype(config.dtype)
    method = config.quantization_method()
    quantizer = WeightQuantizer(method, config.quantization_group_size) if method else None
    tensors = header_tensors(files)
    weights = tensor_bytes(
        tensors, dtype, size_of=quantizer.tensor_bytes if quantizer else None, device=device
    )
    kv_cache = kv_cache_reservation(config, device_budget_bytes)
    on_cuda = device is not None and device.startswith("cuda")
    scratch = (
        0 if on_cuda else _fused_scratch(artifact_dir, tensors, config, dtype, quantizer, kv_cache)
    )
    return weights + kv_cache + _RUNTIME_OVERHEAD_BYTES + scratch


def _fused_scratch(
    artifact_dir: Path,
    tensors: list[HeaderTensor],
    config: LLMConfig,
    dtype: torch.dtype | None,
    quantizer: WeightQuantizer | None,
    kv_cache: int,
) -> int:
    """Bytes the fused CPU step would hold for this model (its scratch grows with
    `max_num_batched_tokens` and the cores, its rotary tables with the longest context):
    counted where the step may run: a float32 model (as loaded) of its families, int8 or
    unquantized, whatever the device (placement is decided later)."""
    if not config.fused_step:
        return 0
    floats = {t.dtype for t in tensors if t.floating}
    int4 = quantizer is not None and any(
        quantizer.stores_int4(t.name, t.shape) for t in tensors if t.floating
    )
    if int4:  # an int4 layer keeps the model on the transformers path
        return 0
    if (dtype is not None and dtype != torch.float32) or (dtype is None and floats != {"F32"}):
        return 0  # not float32 once loaded
    try:
        from transformers import AutoConfig

        # The config as the model is built from it: transformers' defaults filled in.
        model_config = AutoConfig.from_pretrained(artifact_dir, local_files_only=True)
        per_block = kv_bytes_per_block(model_config, config.block_size, torch.float32)
        limits = [int(model_config.max_position_embeddings)]
        limits.append(kv_cache // per_block * config.block_size)
    except Exception:  # any config the load refuses: it holds nothing
        return 0
    if config.max_model_len is not None:
        limits.append(config.max_model_len)
    return predicted_scratch_bytes(
        model_config.to_dict(),
        max_context=max(1, min(limits)),
        max_rows=config.max_num_batched_tokens,
        threads=cores(),
    )
