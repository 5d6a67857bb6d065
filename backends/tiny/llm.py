"""Tiny causal LLMs with random weights, built into a folder on the spot.

Contract: `build_tiny_llm(out_dir, arch)` writes a complete Hugging Face model folder for one
of `TINY_LLM_ARCHITECTURES` (config.json, generation_config.json, model.safetensors and the
byte-level BPE tokenizer of `backends.tiny.tokenizer`) and returns `out_dir`. The folder
loads offline with `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`.
Weights are float32, saved as safetensors only, and depend on `seed` alone, so two builds with
the same arguments give byte-identical weight files.

The weights are drawn wider than a real initialisation (`initializer_range` 0.2) so that
greedy decoding wanders over many tokens instead of repeating one, and logits are not near-ties
everywhere: tests comparing two implementations of the same model get a clear argmax.

`build_benchmark_llm` writes a Llama of about `target_params` parameters (a realistic shape:
head_dim 64, grouped-query attention, SwiGLU width ~8/3 of hidden) for throughput benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GenerationConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from backends.tiny.tokenizer import build_tokenizer

TINY_LLM_ARCHITECTURES: tuple[str, ...] = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma2",
    "gemma3_text",
    "granite",
    "olmo2",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
)

INITIALIZER_RANGE = 0.2
BENCHMARK_VOCAB_SIZE = 8192
BENCHMARK_HEAD_DIM = 64

# The ids `build_tokenizer` gives its special tokens.
_DEFAULT_TOKEN_IDS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}

_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "phi3": Phi3Config,
    "gemma2": Gemma2Config,
    "gemma3_text": Gemma3TextConfig,
    "granite": GraniteConfig,
    "olmo2": Olmo2Config,
    "mixtral": MixtralConfig,
    "qwen2_moe": Qwen2MoeConfig,
    "qwen3_moe": Qwen3MoeConfig,
}

# Mixture-of-experts models: few experts, two picked per token, so that every expert gets
# tokens in a short test and routing differs between tokens.
_MOE_EXPERTS = 4
_MOE_TOP_K = 2

# Per-architecture settings on top of the shared ones, following each family's small
# checkpoints: Qwen ties the output head to the embeddings, Llama, Mistral and Phi-3 do not.
# Gemma2 checkpoints tie too, but a random tied Gemma2 predicts its input token back (the
# embedding enters scaled by sqrt(hidden_size) and dominates the residual stream), so greedy
# decoding repeats one token forever; it is built untied (override to test the tied path).
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False},
    "mistral": {"tie_word_embeddings": False, "sliding_window": 4096},
    # Qwen2/3 checkpoints ship sliding_window but keep it off (use_sliding_window=False).
    "qwen2": {"tie_word_embeddings": True, "use_sliding_window": False},
    "qwen3": {"tie_word_embeddings": True, "use_sliding_window": False},
    "phi3": {"tie_word_embeddings": False},
    # Gemma2 alternates sliding-window and global layers and soft-caps attention and final
    # logits; its config class supplies the layer pattern and both soft caps.
    "gemma2": {
        "tie_word_embeddings": False,
        "sliding_window": 4096,
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    # Gemma 3 interleaves local (sliding-window) and global layers with a rotary base each,
    # the global one scaled (linear, factor 8, as the 4B+ checkpoints ship); no soft-capping
    # but q/k norms. Untied for the reason Gemma2 is. The layer pattern is set per depth in
    # `tiny_llm_config`: alternating, so a two-layer model has one of each. Its q/k norms damp
    # attention, so weights drawn at 0.2 settle into repeating a token; 0.3 keeps it varied.
    "gemma3_text": {
        "tie_word_embeddings": False,
        "initializer_range": 0.3,
        "sliding_window": 4096,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        },
    },
    # Granite scales embeddings, residuals, attention scores and logits by constants (those
    # of granite-3.0-2b, with the attention multiplier at 1/head_dim as there).
    "granite": {
        "tie_word_embeddings": False,
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "logits_scaling": 8.0,
    },
    "olmo2": {"tie_word_embeddings": False},
    "mixtral": {
        "tie_word_embeddings": False,
        "num_local_experts": _MOE_EXPERTS,
        "num_experts_per_tok": _MOE_TOP_K,
    },
    # Qwen2-MoE adds a gated shared expert beside the routed ones; Qwen3-MoE has none.
    "qwen2_moe": {
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "num_experts": _MOE_EXPERTS,
        "num_experts_per_tok": _MOE_TOP_K,
    },
    "qwen3_moe": {
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "num_experts": _MOE_EXPERTS,
        "num_experts_per_tok": _MOE_TOP_K,
        "norm_topk_prob": True,
    },
}


def tiny_llm_config(
    arch: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    intermediate_size: int | None = None,
    token_ids: dict[str, int] | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> PretrainedConfig:
    """The transformers config of a tiny `arch` model; `config_overrides` win over everything.

    The MLP is `intermediate_size` wide, twice `hidden_size` unless given; `token_ids` holds
    bos/eos/pad ids (those of `build_tokenizer` by default).
    """
    if arch not in _CONFIG_CLASSES:
        raise ValueError(
            f"unknown arch {arch!r}; choose one of {', '.join(TINY_LLM_ARCHITECTURES)}"
        )
    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size={hidden_size} is not a multiple of num_heads={num_heads}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    head_dim = hidden_size // num_heads
    ids = token_ids if token_ids is not None else _DEFAULT_TOKEN_IDS
    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size
        if intermediate_size is not None
        else 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": INITIALIZER_RANGE,
        **ids,
        **_ARCH_DEFAULTS[arch],
    }
    # Qwen3 and Gemma default head_dim to 128/256 rather than hidden_size // num_heads.
    if arch in ("llama", "mistral", "qwen3", "gemma2", "gemma3_text", "mixtral"):
        kwargs["head_dim"] = head_dim
    if arch in ("gemma2", "gemma3_text"):
        kwargs["query_pre_attn_scalar"] = head_dim
    if arch == "gemma3_text":
        kwargs["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        ]
    if arch == "granite":
        kwargs["attention_multiplier"] = 1.0 / head_dim
    if arch in ("qwen2_moe", "qwen3_moe"):
        # Each expert as wide as the dense MLP would be; Qwen2-MoE's shared expert too.
        kwargs["moe_intermediate_size"] = kwargs["intermediate_size"]
        if arch == "qwen2_moe":
            kwargs["shared_expert_intermediate_size"] = kwargs["intermediate_size"]
    if arch == "phi3":
        kwargs["original_max_position_embeddings"] = max_position_embeddings
    kwargs.update(config_overrides or {})
    return _CONFIG_CLASSES[arch](**kwargs)


def build_tiny_llm(
    out_dir: Path,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Build a random tiny `arch` model with its tokenizer into `out_dir` and return it."""
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(out_dir, vocab_size=vocab_size)
    config = tiny_llm_config(
        arch,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        token_ids=_token_ids(tokenizer),
        config_overrides=config_overrides,
    )
    _save_random_model(config, out_dir, seed)
    return out_dir


@dataclass(frozen=True)
class BenchmarkShape:
    """A Llama shape: width, depth and attention heads (head_dim 64, GQA 2:1)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int

    def num_parameters(self, vocab_size: int = BENCHMARK_VOCAB_SIZE) -> int:
        """Parameters of an untied Llama of this shape (embeddings and head included)."""
        h, kv_dim = self.hidden_size, self.num_kv_heads * BENCHMARK_HEAD_DIM
        attention = 2 * h * h + 2 * h * kv_dim
        mlp = 3 * h * self.intermediate_size
        per_layer = attention + mlp + 2 * h  # two RMSNorm weights
        return 2 * vocab_size * h + self.num_layers * per_layer + h


def benchmark_shape(target_params: int, vocab_size: int = BENCHMARK_VOCAB_SIZE) -> BenchmarkShape:
    """The narrowest Llama shape whose depth stays within hidden_size / 64 for `target_params`.

    Real models keep depth and width in proportion (768 wide and 12 deep, 2048 wide and 22
    deep); taking the narrowest width that reaches the target without going deeper than that
    ratio gives shapes like those: about 512 x 6 for 25M parameters and 896 x 10 for 100M.
    """
    shape = _shape(256, 2)
    if target_params < shape.num_parameters(vocab_size):
        raise ValueError(
            f"target_params={target_params} is below the smallest benchmark shape "
            f"({shape.num_parameters(vocab_size)} parameters); use build_tiny_llm instead"
        )
    # Widths step by 128 so head counts stay even (grouped-query attention 2:1).
    for hidden_size in range(256, 8192 + 1, 2 * BENCHMARK_HEAD_DIM):
        fixed = _shape(hidden_size, 0).num_parameters(vocab_size)
        per_layer = _shape(hidden_size, 1).num_parameters(vocab_size) - fixed
        ideal_layers = (target_params - fixed) / per_layer
        shape = _shape(hidden_size, max(2, round(ideal_layers)))
        if ideal_layers <= hidden_size / BENCHMARK_HEAD_DIM:
            break
    return shape


def build_benchmark_llm(out_dir: Path, *, target_params: int = 25_000_000, seed: int = 0) -> Path:
    """Build a random Llama of about `target_params` parameters into `out_dir` and return it."""
    out_dir = Path(out_dir)
    shape = benchmark_shape(target_params)
    tokenizer = build_tokenizer(out_dir, vocab_size=BENCHMARK_VOCAB_SIZE)
    config = tiny_llm_config(
        "llama",
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        vocab_size=BENCHMARK_VOCAB_SIZE,
        max_position_embeddings=4096,
        intermediate_size=shape.intermediate_size,
        token_ids=_token_ids(tokenizer),
        # 1/sqrt(hidden) keeps activations of order one through a model this wide and deep
        # (the tiny models' 0.2 would grow them layer by layer and overflow float16).
        config_overrides={"initializer_range": round(shape.hidden_size**-0.5, 4)},
    )
    _save_random_model(config, out_dir, seed)
    return out_dir


def _shape(hidden_size: int, num_layers: int) -> BenchmarkShape:
    num_heads = hidden_size // BENCHMARK_HEAD_DIM
    num_kv_heads = num_heads // 2
    # SwiGLU width: 8/3 of hidden, rounded up to a multiple of 64 as Llama does.
    intermediate_size = -(-(8 * hidden_size) // (3 * 64)) * 64
    return BenchmarkShape(hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size)


def _token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    return {name: int(value) for name, value in ids.items() if value is not None}


def _save_random_model(config: PretrainedConfig, out_dir: Path, seed: int) -> None:
    """Instantiate `config` with seeded random float32 weights and save it as safetensors."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
