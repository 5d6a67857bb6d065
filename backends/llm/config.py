"""Engine settings, taken once from a model version's checked runtime config and frozen.

The runtime config (`backends.runtime_config.LLMConfig`) checks each key's type and range at
registration; `EngineConfig.from_runtime_config` resolves what depends on the device (the
KV-cache reservation given as a share of its budget). Keys the engine does not use (`dtype`,
read by the loader; `keep_alive`, `pin`, `device`, read by the hub) are left to their owners.

| key | default | meaning |
| --- | --- | --- |
| `kv_cache_bytes` | 256MiB | KV-cache reservation, bytes or a size string ("64MiB") |
| `kv_cache_fraction` | - | reservation as a fraction of the device budget instead |
| `block_size` | 16 | tokens per KV-cache block |
| `max_num_seqs` | 64 | sequences in one step at most |
| `max_num_batched_tokens` | 512 | tokens (prefill chunks plus decodes) in one step at most |
| `max_model_len` | model's | prompt plus generated tokens of one sequence at most |
| `enable_prefix_caching` | true | reuse KV blocks of identical prompt prefixes |
| `max_n` | 8 | largest `n` (samples per request) accepted |
| `max_tokens_limit` | max_model_len | largest `max_tokens` accepted |
| `default_max_tokens` | 256 | `max_tokens` of a request that sets none (capped by the context) |
| `max_logprobs` | 20 | largest `logprobs` / `top_logprobs` accepted |
| `max_waiting` | 1024 | requests queued before new ones are refused with "retry later" |
| `max_queue_time_ms` | hub's | longest estimated work ahead of a request on its device; then 503 |
| `priority_aging_steps` | 256 | a waiting request gains one priority level per this many steps |
| `max_loras` | 8 | LoRA adapters on the device at once (slots; more take turns, LRU) |
| `max_lora_rank` | 64 | largest LoRA rank an adapter may have |
| `fused_step` | true | float32 Llama-family models (Phi-3 too) on a CPU: steps in one native call |
| `cuda_graphs` | auto | decode steps on CUDA replay captured graphs (`decode_graphs`); auto: on |
| `speculative` | none | drafts verified in one step (`backends.llm.speculative`) |
| `cuda_graph_mode` | capture | "compile": torch.compile(mode="reduce-overhead") makes them |
| `gpu_fused_ops` | true | CUDA: RMSNorm, rotary, SiLU-and-multiply one Triton kernel each |
| `async_steps` | false | a greedy decode step launches before the last one's tokens land |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from backends.errors import LoadError
from backends.runtime_config import (
    LLMConfig,
    RuntimeConfig,
    RuntimeConfigError,
    SpeculativeConfig,
)

DEFAULT_KV_CACHE_BYTES = 256 * 2**20
_CONFIG = LLMConfig()  # the runtime config's defaults are the engine's


def llm_config(runtime_config: RuntimeConfig | Mapping[str, Any]) -> LLMConfig:
    """The typed config (a mapping is checked first); LoadError naming the key otherwise."""
    try:
        return LLMConfig.parse(runtime_config)
    except RuntimeConfigError as e:
        raise LoadError(str(e)) from e


def kv_cache_reservation(config: LLMConfig, device_budget_bytes: int | None) -> int:
    """Bytes reserved for the KV cache: `kv_cache_bytes`, else `kv_cache_fraction` of the
    device budget, else the default (the config model refuses both at once)."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    if config.kv_cache_fraction is None:
        return DEFAULT_KV_CACHE_BYTES
    if device_budget_bytes is None:
        raise LoadError(
            "kv_cache_fraction needs the device budget to size the KV cache, and none was "
            "given; set kv_cache_bytes instead or place the model on a budgeted device"
        )
    return int(device_budget_bytes * config.kv_cache_fraction)


@dataclass(frozen=True)
class EngineConfig:
    """How one engine batches, caches and limits requests; see the module table."""

    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    block_size: int = _CONFIG.block_size
    max_num_seqs: int = _CONFIG.max_num_seqs
    max_num_batched_tokens: int = _CONFIG.max_num_batched_tokens
    # None: the model's own context length; the runner caps it further by the cache size.
    max_model_len: int | None = None
    enable_prefix_caching: bool = _CONFIG.enable_prefix_caching
    max_n: int = _CONFIG.max_n
    max_tokens_limit: int | None = None
    default_max_tokens: int = _CONFIG.default_max_tokens
    max_logprobs: int = _CONFIG.max_logprobs
    max_waiting: int = _CONFIG.max_waiting
    max_queue_time_s: float | None = None
    priority_aging_steps: int = _CONFIG.priority_aging_steps
    max_loras: int = _CONFIG.max_loras
    max_lora_rank: int = _CONFIG.max_lora_rank
    fused_step: bool = _CONFIG.fused_step
    cuda_graphs: bool | Literal["auto"] = _CONFIG.cuda_graphs
    cuda_graph_mode: Literal["capture", "compile"] = _CONFIG.cuda_graph_mode
    gpu_fused_ops: bool = _CONFIG.gpu_fused_ops
    async_steps: bool = _CONFIG.async_steps
    # Speculative decoding; None: off.
    speculative: SpeculativeConfig | None = None

    @classmethod
    def from_runtime_config(
        cls, runtime_config: LLMConfig | Mapping[str, Any], device_budget_bytes: int | None = None
    ) -> EngineConfig:
        """The engine's settings from a runtime config (checked here when a mapping) and the
        device's budget; LoadError naming the key for a bad one."""
        config = llm_config(runtime_config)
        return cls(
            kv_cache_bytes=kv_cache_reservation(config, device_budget_bytes),
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            max_n=config.max_n,
            max_tokens_limit=config.max_tokens_limit,
            default_max_tokens=config.default_max_tokens,
            max_logprobs=config.max_logprobs,
            max_waiting=config.max_waiting,
            max_queue_time_s=(
                None if config.max_queue_time_ms is None else config.max_queue_time_ms / 1000
            ),
            priority_aging_steps=config.priority_aging_steps,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
            fused_step=config.fused_step,
            cuda_graphs=config.cuda_graphs,
            cuda_graph_mode=config.cuda_graph_mode,
            gpu_fused_ops=config.gpu_fused_ops,
            async_steps=config.async_steps,
            speculative=config.speculative,
        )
