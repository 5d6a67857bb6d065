"""Which decoder architectures the engine runs, decided from a model's `config.json` alone.

Contract: `SUPPORTED_ARCHITECTURES` maps each `model_type` whose greedy output was verified
equal to transformers' `generate` (tests/backends/llm/test_correctness.py, many requests at
once with chunked prefill, prefix hits and preemption) to a short description.
`check_supported(config)` raises `InputError` naming the supported ones for anything else, and
`folder_problem(folder, kind)` says why a model folder cannot be served, or None; the hub
calls the latter at registration, so an unsupported model is refused there (400) rather than
registered and failing at every first load. Nothing here imports torch or transformers.

Every architecture runs as the stock transformers class with our paged attention registered
as its attention function (`backends.llm.attention`); mixture-of-experts layers are the
stock transformers modules too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from backends.errors import InputError

# model_type -> what was verified: greedy output equal to transformers' generate.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "Llama",
    "mistral": "Mistral (sliding window)",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "phi3": "Phi-3",
    "gemma2": "Gemma 2 (alternating sliding window, soft-capping)",
    "gemma3_text": "Gemma 3 text (interleaved local/global layers, rotary base per layer type)",
    "granite": "Granite (scaled embeddings, residuals, attention and logits)",
    "olmo2": "OLMo 2",
    "mixtral": "Mixtral (mixture of experts)",
    "qwen2_moe": "Qwen2-MoE (mixture of experts with a shared expert)",
    "qwen3_moe": "Qwen3-MoE (mixture of experts)",
}


def supported_list() -> str:
    return ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())


def unsupported_reason(config: Mapping[str, Any]) -> str | None:
    """Why the engine cannot run the model of this `config.json`, or None when it can."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        hint = ""
        if isinstance(config.get("text_config"), Mapping):
            hint = (
                " (a multimodal checkpoint: register its text-only variant, e.g. model_type "
                "gemma3_text for Gemma 3)"
            )
        return (
            f"architecture {model_type!r} is not supported by the LLM engine{hint}; "
            f"supported: {supported_list()}"
        )
    if config.get("use_bidirectional_attention"):
        # EmbeddingGemma and the like: an encoder in a decoder's config, not a causal LM.
        return (
            f"{model_type} with use_bidirectional_attention is an embedding model, not a "
            "causal LM; register it with kind 'embedder'"
        )
    return None


def check_supported(config: Mapping[str, Any]) -> None:
    """Raise `InputError` (400) unless the engine runs the model of this `config.json`."""
    reason = unsupported_reason(config)
    if reason is not None:
        raise InputError(reason, param="source")


def folder_problem(folder: Path, kind: str) -> str | None:
    """Why the model folder cannot be served as `kind`, or None. Only LLMs are checked here
    (their architecture); the registry checks files, weights and kind itself."""
    if kind != "llm":
        return None
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"cannot read {path.name}: {e}"
    if not isinstance(config, dict):
        return f"{path.name} must hold a JSON object"
    return unsupported_reason(config)
