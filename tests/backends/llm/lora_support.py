"""Tiny PEFT LoRA adapters built on the spot over the tiny test models, and transformers +
PEFT's greedy output as the reference the engine must match."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.backends.llm.support import greedy_with_tops

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = "all-linear"


def build_adapter(
    base: Path,
    out: Path,
    targets: list[str] | str,
    *,
    r: int = 4,
    alpha: float = 16.0,
    seed: int = 0,
    safe: bool = True,
    **options: Any,
) -> Path:
    """A PEFT LoRA adapter for the model in `base`, saved in `out`. Both A and B are random
    (`init_lora_weights=False`), so the adapter's output really differs from the base's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if (out / "adapter_config.json").is_file():
        return out
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        task_type="CAUSAL_LM",
        init_lora_weights=False,
        **options,
    )
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out, safe_serialization=safe)
    return out


def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def peft_greedy(
    base: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int, top: int = 5
) -> list[tuple[list[int], list[set[int]]]]:
    """Per prompt: transformers + PEFT's greedy tokens with `adapter` (None: the base alone)
    and its top-`top` token ids at each position."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float32, attn_implementation="eager"
    )
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return greedy_with_tops(model, prompts, max_tokens, top)
