"""Greedy output equals transformers' `generate` token for token, for every supported
architecture, with many requests in flight at once and the engine's tricks all exercised:
chunked prefill (prompts longer than a step's token budget), prefix-cache hits (prompts
sharing a prefix), `n > 1`, and preemption (a KV cache too small for the load).

Llama-family models run their steps in the fused CPU kernel (backends/llm/fused) by default;
the preempting run turns it off and also takes the decode attention path meant for
accelerators (one padded, masked call instead of one call per sequence), so every path is
checked on CPU, and a third run checks the fused step under preemption.

A divergence is accepted only at a numeric near-tie, vLLM's rule: at the first position
where the two differ, each side's token is among the other side's five most likely. The
test reports how many outputs were exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from backends.llm.cpu_linear import linear_kernel
from backends.llm.fused.decoder import FAMILIES
from backends.llm.fused.kernel import fused_kernel
from backends.llm.sampling_params import SamplingParams
from backends.tiny import TINY_LLM_ARCHITECTURES
from tests.backends.llm.support import (
    Completion,
    build_model,
    greedy_with_tops,
    kv_bytes,
    make_engine,
    random_prompts,
    run_all,
)

MAX_TOKENS = 16
TOP = 5
BLOCK_SIZE = 4
STEP_BUDGET = 32


def workload() -> list[tuple[list[int], SamplingParams]]:
    """16 prompts of 3 to 60 tokens; six share a 20-token prefix; every fifth asks n=2."""
    shared = random_prompts(1, seed=100, lengths=(20, 20))[0]
    prompts = [shared + p for p in random_prompts(6, seed=101, lengths=(1, 30))]
    prompts += random_prompts(10, seed=102, lengths=(3, 48))
    assert max(len(p) for p in prompts) > STEP_BUDGET  # so a prompt must be chunked
    return [
        (
            p,
            SamplingParams(
                temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP, n=2 if i % 5 == 0 else 1
            ),
        )
        for i, p in enumerate(prompts)
    ]


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("correctness-models")


def hf_reference(folder: Path, prompts: list[list[int]]) -> list[tuple[list[int], list[set[int]]]]:
    """Per prompt: transformers' greedy tokens and its top-5 token ids at each position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    return greedy_with_tops(model, prompts, MAX_TOKENS, TOP)


def compare(ref: tuple[list[int], list[set[int]]], ours: Completion) -> str:
    """ "exact", "near-tie", or a description of a real divergence."""
    hf_tokens, hf_tops = ref
    if ours.token_ids == hf_tokens:
        return "exact"
    for i, (a, b) in enumerate(zip(hf_tokens, ours.token_ids, strict=False)):
        if a != b:
            our_top = {t for t, _ in ours.logprobs[i].top}
            if b in hf_tops[i] and a in our_top:
                return "near-tie"
            return (
                f"diverged at {i}: hf {a} (our top-5 {sorted(our_top)}), "
                f"ours {b} (hf top-5 {sorted(hf_tops[i])})"
            )
    return f"lengths differ: hf {len(hf_tokens)} tokens, ours {len(ours.token_ids)}"


def check_run(name: str, refs: list[Any], results: list[list[Completion]]) -> int:
    verdicts = [
        compare(ref, c) for ref, samples in zip(refs, results, strict=True) for c in samples
    ]
    exact = verdicts.count("exact")
    print(f"{name}: {exact}/{len(verdicts)} outputs exact, {verdicts.count('near-tie')} near-ties")
    failures = [v for v in verdicts if v not in ("exact", "near-tie")]
    assert not failures, f"{name}: {failures}"
    return exact


@pytest.mark.parametrize("arch", TINY_LLM_ARCHITECTURES)
def test_greedy_output_equals_transformers_generate(arch: str, models_root: Path) -> None:
    folder = build_model(models_root, arch)
    requests = workload()
    refs = hf_reference(folder, [p for p, _ in requests])

    # Chunked prefill, prefix caching and n=2, with a queue (8 sequences at a time). Decode
    # attention: the native CPU kernel where a C compiler is found, else the torch path. A
    # Llama-family model runs its steps fused (backends/llm/fused) where the kernel builds.
    engine = make_engine(
        folder, block_size=BLOCK_SIZE, max_num_seqs=8, max_num_batched_tokens=STEP_BUDGET
    )
    fused = arch in FAMILIES and fused_kernel(engine.runner.kernels) is not None
    assert (engine.runner.fused.decoder is not None) == fused
    exact = check_run(f"{arch} chunked+prefix+n", refs, run_all(engine, requests))
    assert engine.kv_cache.prefix_hits > 0
    assert exact >= len(requests) // 2, "near-ties should be the exception"
    assert (engine.runner.fused.steps > 0) == fused

    # 24 blocks of 4 tokens: a third of what the load needs, so sequences get preempted.
    # This run takes the transformers modules (the fused step off) and the accelerators'
    # decode path (one padded, masked call per layer).
    preempting = {"kv_cache_bytes": kv_bytes(folder, 24, BLOCK_SIZE), "max_num_batched_tokens": 64}
    engine = make_engine(
        folder,
        batched_decode=True,
        block_size=BLOCK_SIZE,
        max_num_seqs=8,
        fused_step=False,
        **preempting,
    )
    # Linear layers at up to 8 rows: the native kernel wherever it builds.
    assert linear_kernel(engine.runner.kernels) is None or engine.runner.native_linear > 0
    exact = check_run(f"{arch} preemption+batched decode", refs, run_all(engine, requests))
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.pool.num_used_blocks == 0
    assert engine.runner.fused.steps == 0

    if fused:  # and fused, under preemption
        engine = make_engine(folder, block_size=BLOCK_SIZE, max_num_seqs=8, **preempting)
        check_run(f"{arch} preemption+fused", refs, run_all(engine, requests))
        assert engine.scheduler.num_preemptions > 0 and engine.runner.fused.steps > 0
