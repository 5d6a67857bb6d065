"""The models `benchmarks/gpu_check.py` measures, built once per run into DIR/work (random
weights, tokenizers trained on the spot: nothing is downloaded).

- the LLM: a random Llama of TinyLlama-1.1B's shape (2,048 wide, 22 layers, 32 heads, 4 KV
  heads, MLP 5,632, vocabulary 32,000), bfloat16 on a GPU; `--small`: 256 wide, 4 layers,
  vocabulary 4,096, float32 on a CPU;
- the embedder: a BERT of all-MiniLM-L6-v2's shape (384 wide, 6 layers) behind
  sentence-transformers' layout; `tiny` (or `--small`): 32 wide, 2 layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backends.encoders.embedder import EmbedderBackend
    from backends.llm.backend import LLMBackend
    from benchmarks.gpu_sections import Context

BIG = {"hidden_size": 2048, "num_layers": 22, "num_heads": 32, "num_kv_heads": 4,
       "intermediate_size": 5632, "vocab_size": 32000}  # fmt: skip
SMALL = {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2,
         "intermediate_size": 704, "vocab_size": 4096}  # fmt: skip


def llm_dtype(ctx: Context) -> Any:
    import torch

    return torch.bfloat16 if ctx.cuda else torch.float32


def llm_dir(ctx: Context) -> Path:
    """The LLM's folder (safetensors, config, tokenizer), built on first use."""
    folder = ctx.work / ("llama-small" if ctx.small else "llama-1.1b-shape")
    if (folder / ".complete").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM

    from backends.tiny.llm import tiny_llm_config
    from backends.tiny.tokenizer import build_tokenizer

    shape = SMALL if ctx.small else BIG
    config = tiny_llm_config("llama", max_position_embeddings=2048,
                             token_ids={"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2},
                             config_overrides={"initializer_range": 0.02}, **shape)  # fmt: skip
    torch.manual_seed(0)
    # Built on the device (fast), saved in the dtype the sections load.
    with torch.device(ctx.device):
        model = AutoModelForCausalLM.from_config(config, dtype=llm_dtype(ctx))
    model.save_pretrained(folder, safe_serialization=True)
    del model
    build_tokenizer(folder, vocab_size=shape["vocab_size"])
    (folder / ".complete").write_text("ok\n")
    return folder


def hf_llm(ctx: Context, attn: str = "sdpa") -> Any:
    """The LLM as transformers loads it, on the device, in eval mode."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(llm_dir(ctx), dtype=llm_dtype(ctx),
                                                 attn_implementation=attn)  # fmt: skip
    model = model.to(ctx.device).eval()
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return model


def llm_backend(ctx: Context, folder: Path, config: dict[str, Any]) -> LLMBackend:
    """The hub's LLM backend over `folder`, loaded on the device."""
    from backends.base import BackendContext
    from backends.llm.backend import LLMBackend

    backend = LLMBackend(BackendContext("llm", "1", {**config, **ctx.engine_config}))
    backend.load(folder, ctx.device, llm_dtype(ctx))
    return backend


def build_embedder(ctx: Context, *, tiny: bool = False) -> Path:
    from backends.tiny.encoders import build_tiny_embedder

    small = tiny or ctx.small
    folder = ctx.work / ("embedder-tiny" if small else "embedder-minilm-shape")
    if not (folder / "config.json").exists():
        if small:
            build_tiny_embedder(folder)
        else:
            build_tiny_embedder(folder, hidden_size=384, num_layers=6, max_seq_length=256)
    return folder


def embedder_backend(
    ctx: Context, folder: Path, config: dict[str, Any] | None = None
) -> EmbedderBackend:
    from backends.base import BackendContext
    from backends.encoders.embedder import EmbedderBackend

    backend = EmbedderBackend(BackendContext("emb", "1", config or {}))
    backend.load(folder, ctx.device)
    return backend
