"""A roofline for the LLM benchmarks: the machine's measured GEMM peak, a workload's FLOPs,
and how much of that peak a run of it reached.

- `gemm_peak_gflops`: the best of a few large square float32 matmuls (2048^3 by default) in
  this process, with torch's current thread count: what the BLAS reaches here when nothing
  but multiply-adds is asked of it. No serving system does better on the same dtype.
- `workload_flops`: the FLOPs a decoder-only model must do for a workload whatever system
  runs it: every linear layer of the decoder for every token whose key and value are computed
  (the prompt and every generated token but the last), the LM head for every sampled token,
  and attention (scores and the weighted sum: 4 x context x the attention width per token
  and layer). Multiply-adds count two. Padding, recomputation and wasted tokens are the
  system's own cost and are not counted.

The fraction of the roofline is `flops / seconds / peak`. Every run is put against the
float32 peak, also one that computes in another dtype (int8 weights run bfloat16 GEMMs for
long chunks, whose peak on a CPU with AVX512-BF16 is ~2.4x float32's): its fraction says how
it compares with float32 work, not how close it is to its own roofline. Sliding-window
attention and prefix-cache reuse are not modelled (the benchmark's Llama and workload have
neither).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch


def gemm_peak_gflops(size: int = 2048, repeats: int = 5) -> float:
    """GFLOPS of the fastest of `repeats` float32 (size x size) @ (size x size) products."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)  # warm-up: BLAS threads, first-touch of the output
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def _linear_params(model: Any) -> tuple[int, int]:
    """(weights of the decoder's linear layers, weights of the LM head)."""
    head = model.get_output_embeddings()
    decoder = sum(
        module.weight.numel()
        for module in model.modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    )
    return decoder, head.weight.numel()


def workload_flops(model: Any, requests: Sequence[tuple[int, int]]) -> dict[str, float]:
    """FLOPs of `requests`, each (prompt tokens, generated tokens), on a transformers causal
    LM `model`: `linear`, `lm_head`, `attention` and `total`."""
    config = model.config
    decoder, head = _linear_params(model)
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    width = heads * head_dim  # the width of the attention's queries
    computed = sampled = 0
    attention = 0.0
    for prompt, generated in requests:
        tokens = prompt + generated - 1  # the last sampled token is never fed back
        computed += tokens
        sampled += generated
        # Token at position p attends to p + 1 positions: sum over p of (p + 1).
        contexts = tokens * (tokens + 1) / 2
        attention += 4 * contexts * width * layers
    linear = 2.0 * decoder * computed
    lm_head = 2.0 * head * sampled
    return {
        "linear": linear,
        "lm_head": lm_head,
        "attention": attention,
        "total": linear + lm_head + attention,
    }


def roofline(flops: float, peak_gflops: float, runs: dict[str, float]) -> dict[str, Any]:
    """The roofline line for runs of one workload (`runs`: name -> seconds)."""
    return {
        "gemm_peak_gflops": round(peak_gflops, 1),
        "workload_gflop": round(flops / 1e9, 1),
        "seconds_at_peak": round(flops / (peak_gflops * 1e9), 3),
        "achieved_gflops": {name: round(flops / s / 1e9, 1) for name, s in runs.items()},
        "fraction_of_peak": {
            name: round(flops / s / (peak_gflops * 1e9), 3) for name, s in runs.items()
        },
    }
