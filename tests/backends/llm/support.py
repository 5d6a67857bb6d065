"""Helpers for engine tests: tiny models per architecture, an engine over one, and a
synchronous run of many concurrent requests to completion."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from backends.llm.config import EngineConfig
from backends.llm.engine import LLMEngine
from backends.llm.metrics import EngineMetrics
from backends.llm.model_runner import ModelRunner
from backends.llm.sampling_params import SamplingParams
from backends.llm.sequence import FinishReason, Logprob

# A window shorter than the longer prompts, so sliding-window layers really slide.
SLIDING_WINDOW = 16
ARCH_OVERRIDES: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": SLIDING_WINDOW},
    "gemma2": {"sliding_window": SLIDING_WINDOW},
    "gemma3_text": {"sliding_window": SLIDING_WINDOW},
    "mixtral": {"sliding_window": SLIDING_WINDOW},
}
# Token ids from here on are plain text for the tiny tokenizer (below are special tokens).
FIRST_PLAIN_TOKEN = 7


def build_model(root: Path, arch: str) -> Path:
    from backends.tiny import build_tiny_llm

    folder = root / arch
    if not (folder / "config.json").is_file():
        build_tiny_llm(folder, arch, config_overrides=ARCH_OVERRIDES.get(arch))
    return folder


def make_engine(
    folder: Path,
    tokenizer: Any = None,
    *,
    batched_decode: bool | None = None,
    quantization: str | None = None,
    static_decode: bool | None = None,
    metrics: EngineMetrics | None = None,
    **config: Any,
) -> LLMEngine:
    """An engine over `folder` on CPU in float32; `batched_decode` forces the accelerators'
    one-call decode attention (None: the device's default); `quantization` "int8" stores the
    linear layers as int8; `static_decode` runs decode-only steps over the static buffers of
    `backends.llm.decode_graphs`, eagerly."""
    engine_config = EngineConfig(**config)
    runner = ModelRunner.load(
        folder,
        "cpu",
        torch.float32,
        engine_config,
        batched_decode=batched_decode,
        quantization=quantization,
        static_decode=static_decode,
    )
    return LLMEngine(engine_config, runner, tokenizer, metrics)


def kv_bytes(folder: Path, blocks: int, block_size: int) -> int:
    """`kv_cache_bytes` that holds exactly `blocks` blocks of the model in `folder`."""
    from transformers import AutoConfig

    from backends.llm.model_runner import kv_bytes_per_block

    return blocks * kv_bytes_per_block(
        AutoConfig.from_pretrained(folder), block_size, torch.float32
    )


def random_prompts(
    count: int, seed: int, lengths: tuple[int, int], vocab: int = 500
) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(rng.randint(*lengths))]
        for _ in range(count)
    ]


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0


def run_all(
    engine: LLMEngine,
    requests: list[tuple[list[int], SamplingParams]],
    adapters: list[str | None] | None = None,
) -> list[list[Completion]]:
    """Submit every request at once (request i with LoRA adapter `adapters[i]`, if given),
    step to completion; per request, one Completion per sample."""
    results = [[Completion() for _ in range(p.n)] for _, p in requests]
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params, adapter=adapters[i] if adapters else None)
    steps = 0
    while engine.has_work():
        for out in engine.step():
            c = results[int(out.request_id)][out.index]
            c.token_ids += out.token_ids
            c.text += out.text
            c.logprobs += out.logprobs
            c.finish_reason = out.finish_reason
            c.num_cached_tokens = out.num_cached_tokens
        steps += 1
        assert steps < 100_000
    return results


def greedy_with_tops(
    model: Any, prompts: list[list[int]], max_tokens: int, top: int
) -> list[tuple[list[int], list[set[int]]]]:
    """Per prompt: a transformers model's greedy tokens (`generate`) and its top-`top` token
    ids at each position, the reference engine outputs are compared with."""
    model.eval()
    refs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            tops = [set(step[0].topk(top).indices.tolist()) for step in out.logits]
            refs.append((tokens, tops))
    return refs
