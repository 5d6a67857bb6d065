"""int4 against int8 and float32 weights on the engine: decode throughput at concurrency 1
and 32, side by side, on the benchmark Llama (random weights, ~25M parameters).

Each round runs every method once at each concurrency (interleaved, so a slow spell of the
shared machine hits all alike): concurrency 32 submits 32 requests at once (64-token prompts,
`--max-tokens` output tokens each, greedy, EOS ignored), concurrency 1 runs `--c1-requests`
of them one after another. Reported: output tokens/s per method, the median over `--rounds`
rounds, and the ratio of each round to float32's (median). The engine loads the model with
`quantization: int4` (groups of `--group-size`) or `int8`. Results:
benchmarks/results/int4_throughput.json and .png.

    python benchmarks/int4_throughput.py [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as a script from anywhere
    sys.path.insert(0, str(REPO))

from backends.llm.config import EngineConfig  # noqa: E402
from backends.llm.engine import LLMEngine  # noqa: E402
from backends.llm.model_runner import ModelRunner  # noqa: E402
from backends.llm.sampling_params import SamplingParams  # noqa: E402
from backends.tiny import build_benchmark_llm  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
METHODS = ("float32", "int8", "int4")


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, at_once: bool) -> float:
    """Output tokens/s of greedy requests for `prompts`, all at once or one by one."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    produced = 0
    start = time.perf_counter()
    batches = [prompts] if at_once else [[p] for p in prompts]
    for b, batch in enumerate(batches):
        for i, prompt in enumerate(batch):
            engine.add_request(f"{b}-{i}", prompt, params)
        while engine.has_work():
            produced += sum(len(out.token_ids) for out in engine.step())
    seconds = time.perf_counter() - start
    engine.kv_cache.reset_prefix_cache()
    return produced / seconds


def main() -> None:
    from tqdm import tqdm

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--c1-requests", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=RESULTS / "int4_throughput.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 4000) for _ in range(64)] for _ in range(32)]
    config = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, kv_cache_bytes=256 * 2**20)
    rates: dict[str, dict[str, list[float]]] = {"c1": {}, "c32": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_benchmark_llm(Path(tmp) / "model")
        engines = {}
        for method in METHODS:
            quantization = None if method == "float32" else method
            runner = ModelRunner.load(
                folder,
                "cpu",
                torch.float32,
                config,
                quantization=quantization,
                group_size=args.group_size,
            )
            engines[method] = LLMEngine(config, runner, None)
            run(engines[method], prompts[:1], 2, at_once=True)  # warm-up
        with tqdm(total=args.rounds * len(METHODS) * 2, desc="runs", unit="run") as bar:
            for _ in range(args.rounds):
                for method in METHODS:
                    engine = engines[method]
                    c32 = run(engine, prompts, args.max_tokens, at_once=True)
                    rates["c32"].setdefault(method, []).append(c32)
                    bar.update()
                    c1 = run(engine, prompts[: args.c1_requests], args.max_tokens, at_once=False)
                    rates["c1"].setdefault(method, []).append(c1)
                    bar.update()
    result: dict[str, Any] = {
        "model": "benchmark Llama ~25M parameters, random weights",
        "threads": torch.get_num_threads(),
        "group_size": args.group_size,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
    }
    for level, by_method in rates.items():
        base = by_method["float32"]
        result[level] = {
            method: {
                "tokens_per_s_median": statistics.median(values),
                "vs_float32_median_of_rounds": statistics.median(
                    v / b for v, b in zip(values, base, strict=True)
                ),
                "tokens_per_s_rounds": values,
            }
            for method, values in by_method.items()
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("c1", "c32")}, indent=2))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    for ax, level in zip(axes, ("c1", "c32"), strict=True):
        values = [result[level][m]["tokens_per_s_median"] for m in METHODS]
        ax.bar(METHODS, values, color=["#999999", "#ff7f0e", "#1f77b4"])
        ax.set_title(f"concurrency {level[1:]}")
        ax.set_ylabel("output tokens/s (median)")
    fig.suptitle(f"int4 (groups of {result['group_size']}) vs int8 vs float32")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
