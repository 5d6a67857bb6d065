"""Structured-output cost: decode throughput with a JSON-schema constraint against free text,
side by side in one process on the same model and workload, and the grammar cache.

The model is the throughput benchmark's ~25M-parameter Llama (random weights, float32,
vocabulary 8192). Each batch size (1 and 32 requests) runs three modes on the same prompts
and max_tokens, greedy, EOS ignored:

- `free`: no constraint;
- `json`: a JSON schema (an array of at least 64 objects with a bounded string, an integer
  range, an enum and a bounded array, so no output completes before max_tokens and every
  mode produces the same number of tokens), masks filled in a worker thread while the
  forward pass runs (the engine's default);
- `json_no_overlap`: the same, masks filled after the forward pass, in the sampler.

Modes alternate within each of `--rounds` rounds (the CPU is shared), and each round's
ratio to `free` is taken within the round; the report gives median throughput and median
ratios. It also times the grammar compile of a new schema and checks that a second request
with the same schema compiles nothing (the cache's hit and miss counters). Results go to
`benchmarks/results/structured_output.json` and `.png`.

    python benchmarks/structured_output.py [--quick] [--rounds N] [--threads N] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from backends.llm.config import EngineConfig  # noqa: E402
from backends.llm.engine import LLMEngine  # noqa: E402
from backends.llm.model_runner import ModelRunner  # noqa: E402
from backends.llm.sampling_params import SamplingParams  # noqa: E402
from backends.llm.structured import StructuredOutput  # noqa: E402
from backends.tiny import build_benchmark_llm  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"
FIRST_PLAIN_TOKEN = 7
MODES = ("free", "json", "json_no_overlap")

SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "count": {"type": "integer", "minimum": 0, "maximum": 10000},
            "kind": {"enum": ["alpha", "beta", "gamma"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        },
        "required": ["name", "count", "kind", "tags"],
        "additionalProperties": False,
    },
}


def make_engine(model_dir: Path, max_num_seqs: int) -> LLMEngine:
    from transformers import AutoTokenizer

    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512)
    runner = ModelRunner.load(model_dir, "cpu", torch.float32, config)
    return LLMEngine(config, runner, AutoTokenizer.from_pretrained(model_dir))


def params(mode: str, max_tokens: int, spec: StructuredOutput) -> SamplingParams:
    structured = None if mode == "free" else spec
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, structured=structured
    )


def run(
    engine: LLMEngine, prompts: list[list[int]], mode: str, max_tokens: int, spec: StructuredOutput
) -> dict[str, float]:
    """Tokens per second of decoding `prompts` to max_tokens each, all at once."""
    engine.runner.sampler.masks.overlap = mode != "json_no_overlap"
    engine.kv_cache.reset_prefix_cache()
    for i, prompt in enumerate(prompts):
        engine.add_request(
            f"{mode}-{i}-{time.perf_counter()}", prompt, params(mode, max_tokens, spec)
        )
    produced = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_work():
        produced += sum(len(o.token_ids) for o in engine.step())
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return {
        "tokens": produced,
        "seconds": seconds,
        "tokens_per_s": produced / seconds,
        # This process's CPU time over all its threads (grammar work included): less
        # sensitive than wall time to other work on a shared CPU.
        "cpu_seconds": cpu,
        "tokens_per_cpu_s": produced / cpu,
    }


def compile_cache(engine: LLMEngine) -> dict[str, Any]:
    """A new schema compiles once; the same schema again is a cache hit with no compile."""
    grammars = engine.grammars
    assert grammars is not None
    schema = {**SCHEMA, "description": f"fresh {time.time()}"}  # not in the cache yet
    spec = StructuredOutput.json_schema(schema)
    metrics = grammars.metrics
    start = time.perf_counter()
    grammars.compile(spec)
    first = time.perf_counter() - start
    misses, compile_total = metrics.misses, metrics.compile_seconds
    start = time.perf_counter()
    grammars.compile(StructuredOutput.json_schema(json.loads(json.dumps(schema))))
    second = time.perf_counter() - start
    return {
        "first_request_compile_ms": first * 1000,
        "second_request_lookup_ms": second * 1000,
        "second_request_compiled": metrics.misses != misses
        or metrics.compile_seconds != compile_total,
        "cache_hits": metrics.hits,
        "cache_misses": metrics.misses,
    }


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = results["batches"]
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5))
    for ax, (batch, data) in zip(axes, batches.items(), strict=True):
        rates = [data["median_tokens_per_s"][m] for m in MODES]
        bars = ax.bar(MODES, rates, color=["#999999", "#1f77b4", "#aec7e8"])
        ratios = [1.0] + [data["median_ratio_to_free"][m] for m in MODES[1:]]
        ax.bar_label(
            bars, labels=[f"{r:.0f} ({q:.2f}x)" for r, q in zip(rates, ratios, strict=True)]
        )
        ax.set_ylabel("output tokens / s (median; ratio to free: median of per-round ratios)")
        ax.set_title(f"batch {batch}: JSON schema vs free text")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small run (smoke test)")
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 32])
    parser.add_argument("--out", type=Path, default=RESULTS / "structured_output.json")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads (default: torch's). On a shared 2-core machine 1 keeps "
        "OpenMP's spinning barriers out of the comparison; the mask worker then has a core",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.rounds, args.max_tokens, args.batches = 1, 16, [1, 4]
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="structured-bench-")) / "llm"
    if not (model_dir / "config.json").is_file():
        build_benchmark_llm(model_dir)
    engine = make_engine(model_dir, max(args.batches))
    spec = StructuredOutput.json_schema(SCHEMA)
    engine.grammars.compile(spec)  # type: ignore[union-attr]
    rng = random.Random(0)
    vocab = engine.runner.vocab_size
    prompts = [
        [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(16)]
        for _ in range(max(args.batches))
    ]
    run(engine, prompts[:2], "json", 4, spec)  # warm-up: threads, kernels
    rounds: dict[int, list[dict[str, dict[str, float]]]] = {b: [] for b in args.batches}
    for r in range(args.rounds):
        for batch in args.batches:
            result = {m: run(engine, prompts[:batch], m, args.max_tokens, spec) for m in MODES}
            rounds[batch].append(result)
            line = ", ".join(
                f"{m} {v['tokens_per_s']:.1f} tok/s ({v['tokens_per_cpu_s']:.1f} per CPU s)"
                for m, v in result.items()
            )
            print(f"round {r + 1} batch {batch}: {line}", flush=True)
    batches: dict[str, Any] = {}
    for batch, runs in rounds.items():
        batches[str(batch)] = {
            "tokens_per_run": {m: runs[0][m]["tokens"] for m in MODES},
            "median_tokens_per_s": {
                m: statistics.median(x[m]["tokens_per_s"] for x in runs) for m in MODES
            },
            "median_ratio_to_free": {
                m: statistics.median(x[m]["tokens_per_s"] / x["free"]["tokens_per_s"] for x in runs)
                for m in MODES[1:]
            },
            "median_tokens_per_cpu_s": {
                m: statistics.median(x[m]["tokens_per_cpu_s"] for x in runs) for m in MODES
            },
            "median_cpu_ratio_to_free": {
                m: statistics.median(
                    x[m]["tokens_per_cpu_s"] / x["free"]["tokens_per_cpu_s"] for x in runs
                )
                for m in MODES[1:]
            },
            "rounds": runs,
        }
    results = {
        "model": "llama ~25M params, vocab 8192, float32, CPU",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_after": os.getloadavg(),
        },
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "schema": SCHEMA,
        "batches": batches,
        "compile_cache": compile_cache(engine),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    summary = {
        b: {
            "tok/s": v["median_tokens_per_s"],
            "ratio": v["median_ratio_to_free"],
            "cpu_ratio": v["median_cpu_ratio_to_free"],
        }
        for b, v in batches.items()
    }
    print(json.dumps({"batches": summary, "compile_cache": results["compile_cache"]}, indent=2))


if __name__ == "__main__":
    main()
