"""LLM throughput: our paged-attention engine against transformers on one CPU, side by side.

All four systems run in this one process on the same ~25M-parameter Llama (random weights,
float32) and the same workload: 64 requests, prompts of 16-256 tokens, max_tokens of 8-256,
drawn from a fixed seed, greedy, every request generating exactly its max_tokens (EOS is
ignored), so every system produces the same number of useful tokens.

- `hf_one_at_a_time`: `model.generate` per request, in arrival order.
- `hf_static_batching`: left-padded batches of `--static-batch-size` requests in arrival
  order; a batch generates until its longest request is done (tokens past a request's own
  max_tokens are wasted and not counted).
- `hf_generate_batch`: transformers' own continuous batching (`generate_batch`'s manager,
  with each request's own max_new_tokens), started before the clock.
- `engine`: our `LLMEngine`, text detokenized as it would be for a client.
- `engine_torch_attention`: the same engine with its native CPU kernels off (decode
  attention in plain torch, no fused step), as it runs where no C compiler is found.
- `engine_transformers`: the engine with its steps through the transformers modules
  (`fused_step: false`; the native decode attention and few-row linear kernels on), as it
  ran before the fused step; `engine_transformers_c1` the same one request at a time.
- `engine_int8`: the engine with `quantization: int8` (int8 linear layers), same workload;
  `engine_c1` and `engine_int8_c1` run the first `--c1-requests` requests one at a time
  (concurrency 1) in float32 and int8. The int8/float32 ratios of each round are reported.

A roofline line (`benchmarks/roofline.py`): the GEMM peak measured in this process (the best
of a few 2048^3 float32 matmuls), the workload's FLOPs (linear layers, LM head, attention) and
the fraction of that peak each system reached on the whole workload.

It also measures time to first token for a 512-token shared system prompt without and with
a prefix-cache hit, and KV-cache waste (allocated block slots against tokens stored, over
every step of the engine's run). The batched phases run in `--rounds` interleaved rounds
(default 3) and report their medians; the one-at-a-time phase (minutes) runs once. Results
go to `benchmarks/results/llm_throughput.json` and `.png`. `--quick` runs a small workload,
one round, for a smoke test.

    python benchmarks/llm_throughput.py [--quick] [--rounds N] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from backends.llm.config import EngineConfig  # noqa: E402
from backends.llm.engine import LLMEngine  # noqa: E402
from backends.llm.model_runner import ModelRunner  # noqa: E402
from backends.llm.sampling_params import SamplingParams  # noqa: E402
from backends.tiny import build_benchmark_llm  # noqa: E402
from benchmarks.roofline import gemm_peak_gflops, roofline, workload_flops  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"
# Token ids below this are the tokenizer's special tokens; prompts avoid them.
FIRST_PLAIN_TOKEN = 7


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


@dataclass
class Phase:
    name: str
    requests: int
    output_tokens: int
    seconds: float
    # CPU time of this process over the phase: with one torch thread, the work done, which
    # other processes on a shared machine disturb much less than wall time.
    cpu_seconds: float = 0.0
    # With --rounds: every round's seconds; `seconds` and `cpu_seconds` are the medians.
    round_seconds: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.output_tokens / self.cpu_seconds if self.cpu_seconds else 0.0


def workload(
    count: int, seed: int, prompt_range: tuple[int, int], out_range: tuple[int, int], vocab: int
) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(rng.randint(*prompt_range))],
            rng.randint(*out_range),
        )
        for _ in range(count)
    ]


def load_hf(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval()


def generation_config(max_new_tokens: int, pad: int) -> Any:
    from transformers import GenerationConfig

    # No EOS: every request generates exactly its budget, as in the engine's run.
    return GenerationConfig(
        do_sample=False, eos_token_id=None, pad_token_id=pad, max_new_tokens=max_new_tokens
    )


@torch.inference_mode()
def hf_one_at_a_time(
    model: Any, requests: list[Request], pad: int
) -> tuple[Phase, list[list[int]]]:
    model.generate(
        torch.tensor([requests[0].prompt[:8]]), generation_config=generation_config(2, pad)
    )
    outputs = []
    start = time.perf_counter()
    for r in tqdm(requests, desc="hf one at a time", leave=False):
        ids = torch.tensor([r.prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            generation_config=generation_config(r.max_tokens, pad),
        )
        outputs.append(out[0, len(r.prompt) :].tolist())
    seconds = time.perf_counter() - start
    return Phase("hf_one_at_a_time", len(requests), sum(len(o) for o in outputs), seconds), outputs


@torch.inference_mode()
def hf_static_batching(model: Any, requests: list[Request], pad: int, batch_size: int) -> Phase:
    start = time.perf_counter()
    useful = 0
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    for batch in tqdm(batches, desc="hf static batching", leave=False):
        width = max(len(r.prompt) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):  # left padding
            ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt) :] = 1
        longest = max(r.max_tokens for r in batch)
        model.generate(ids, attention_mask=mask, generation_config=generation_config(longest, pad))
        useful += sum(r.max_tokens for r in batch)
    return Phase("hf_static_batching", len(requests), useful, time.perf_counter() - start)


def hf_generate_batch(model: Any, requests: list[Request], pad: int) -> Phase:
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    config = generation_config(max(r.max_tokens for r in requests), pad)
    produced = 0
    with model.continuous_batching_context_manager(
        generation_config=config, block=True, timeout=30
    ) as manager:
        start = time.perf_counter()
        ids = [manager.add_request(r.prompt, max_new_tokens=r.max_tokens) for r in requests]
        for _ in tqdm(ids, desc="hf generate_batch", leave=False):
            result = manager.get_result(timeout=3600)
            produced += len(result.generated_tokens)
        seconds = time.perf_counter() - start
    return Phase("hf_generate_batch", len(requests), produced, seconds)


def make_engine(
    model_dir: Path,
    config: EngineConfig,
    *,
    native_decode: bool = True,
    quantization: str | None = None,
) -> LLMEngine:
    from transformers import AutoTokenizer

    runner = ModelRunner.load(
        model_dir,
        "cpu",
        torch.float32,
        config,
        native_decode=None if native_decode else False,
        quantization=quantization,
    )
    return LLMEngine(config, runner, AutoTokenizer.from_pretrained(model_dir))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def engine_throughput(
    engine: LLMEngine, requests: list[Request], name: str = "engine"
) -> tuple[Phase, list[list[int]], dict[str, float]]:
    engine.add_request("warmup", requests[0].prompt[:8], greedy(2))
    while engine.has_work():
        engine.step()
    engine.kv_cache.reset_prefix_cache()
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
    allocated = stored = 0
    peak_waste = 0.0
    bs = engine.config.block_size
    start = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(str(i), r.prompt, greedy(r.max_tokens))
    with tqdm(
        total=sum(r.max_tokens for r in requests), desc=name, leave=False, mininterval=2.0
    ) as bar:
        while engine.has_work():
            for out in engine.step():
                outputs[out.request_id].extend(out.token_ids)
                bar.update(len(out.token_ids))
            # Slots of the blocks live sequences hold, against the tokens whose KV they store.
            running = engine.scheduler.running
            slots = sum(len(s.block_ids) for s in running) * bs
            tokens = sum(s.num_computed_tokens for s in running)
            allocated += slots
            stored += tokens
            if slots:
                peak_waste = max(peak_waste, 1 - tokens / slots)
    seconds = time.perf_counter() - start
    ordered = [outputs[str(i)] for i in range(len(requests))]
    waste = {"kv_waste_fraction": 1 - stored / allocated, "kv_waste_peak_step": peak_waste}
    phase = Phase(name, len(requests), sum(len(o) for o in ordered), seconds)
    return phase, ordered, waste


def engine_one_at_a_time(engine: LLMEngine, requests: list[Request], name: str) -> Phase:
    """Each request alone (concurrency 1), the next sent when the previous is done."""
    produced = 0
    start = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(f"{name}-{i}", r.prompt, greedy(r.max_tokens))
        while engine.has_work():
            produced += sum(len(out.token_ids) for out in engine.step())
    return Phase(name, len(requests), produced, time.perf_counter() - start)


def ttft(engine: LLMEngine, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.add_request(f"ttft-{start}", prompt, greedy(1))
    while engine.has_work():
        if engine.step():
            return time.perf_counter() - start
    raise RuntimeError("the request produced no token")


def prefix_ttft(engine: LLMEngine, vocab: int, system_len: int, trials: int) -> dict[str, float]:
    rng = random.Random(1)
    cold, warm = [], []
    for _ in tqdm(range(trials), desc="ttft", leave=False):
        system = [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(system_len)]
        first = system + [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(16)]
        second = system + [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(16)]
        cold.append(ttft(engine, first))  # a new system prompt: nothing cached
        warm.append(ttft(engine, second))  # the same system prompt: 512 tokens hit
    return {
        "system_prompt_tokens": system_len,
        "ttft_without_hit_s": statistics.median(cold),
        "ttft_with_hit_s": statistics.median(warm),
        "ttft_speedup": statistics.median(cold) / statistics.median(warm),
    }


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = results["phases"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [2.2, 1]})
    names = [p["name"] for p in phases]
    rates = [p["tokens_per_s"] for p in phases]
    colors = ["#999999"] * (len(phases) - 1) + ["#1f77b4"]
    bars = left.bar(names, rates, color=colors)
    left.bar_label(bars, fmt="%.0f")
    left.set_ylabel("output tokens / s")
    left.set_title(f"Throughput, {results['workload']['requests']} requests, {results['model']}")
    left.tick_params(axis="x", labelsize=8)
    plt.setp(left.get_xticklabels(), rotation=35, ha="right")
    line = results.get("roofline")
    if line:
        # Output tokens/s had the workload run at the measured GEMM peak, and at half of it.
        at_peak = results["phases"][-1]["output_tokens"] / line["seconds_at_peak"]
        left.axhline(
            at_peak,
            color="#d62728",
            linestyle="--",
            label=f"GEMM roofline ({line['gemm_peak_gflops']:.0f} GFLOPS)",
        )
        left.axhline(at_peak / 2, color="#d62728", linestyle=":", label="50% of roofline")
        left.legend(fontsize=8)
    t = results["prefix_cache"]
    if t is None:  # --skip ttft
        right.set_visible(False)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return
    ttfts = [t["ttft_without_hit_s"] * 1000, t["ttft_with_hit_s"] * 1000]
    bars = right.bar(["no prefix hit", "prefix hit"], ttfts, color=["#999999", "#1f77b4"])
    right.bar_label(bars, fmt="%.0f ms")
    right.set_ylabel("time to first token (ms)")
    right.set_title(
        f"{t['system_prompt_tokens']}-token shared system prompt\n"
        f"(KV waste {results['kv_cache']['kv_waste_fraction']:.1%})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def int8_ratios(
    runs: dict[str, list[Phase]], int8_outputs: list[list[int]], fp32_outputs: list[list[int]]
) -> dict[str, Any]:
    """int8 against float32 at concurrency 64 (the workload) and 1: tokens/s of each, and
    the median of the per-round ratios (each round ran both, one after the other)."""
    out: dict[str, Any] = {}
    for label, fp32_name, int8_name in (
        ("concurrency_64", "engine", "engine_int8"),
        ("concurrency_1", "engine_c1", "engine_int8_c1"),
    ):
        if fp32_name not in runs or int8_name not in runs:
            continue
        pairs = list(zip(runs[fp32_name], runs[int8_name], strict=False))
        ratios = [i.tokens_per_s / f.tokens_per_s for f, i in pairs]
        # CPU time (one torch thread) is disturbed much less by a shared machine than wall time.
        cpu_ratios = [i.tokens_per_cpu_s / f.tokens_per_cpu_s for f, i in pairs if f.cpu_seconds]
        out[label] = {
            "fp32_tokens_per_s": statistics.median(f.tokens_per_s for f, _ in pairs),
            "int8_tokens_per_s": statistics.median(i.tokens_per_s for _, i in pairs),
            "int8_speedup_median_of_rounds": statistics.median(ratios),
            "int8_speedup_rounds": ratios,
            "int8_speedup_cpu_time_median_of_rounds": statistics.median(cpu_ratios or [0.0]),
        }
    out["greedy_outputs_equal"] = sum(
        a == b for a, b in zip(int8_outputs, fp32_outputs, strict=True)
    )
    out["requests"] = len(fp32_outputs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small workload (smoke test)")
    parser.add_argument("--model-dir", type=Path, help="reuse (or build into) this folder")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    # HF static batching at the best of batch sizes 8, 16, 32, 64 (docs/benchmarks.md).
    parser.add_argument("--static-batch-size", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--skip", nargs="*", default=[], help="phases to skip (hf_one_at_a_time ...)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds of the batched phases; each reports its median (default 3)",
    )
    parser.add_argument(
        "--c1-requests", type=int, default=8, help="requests of the concurrency-1 phases"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "llm_throughput.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="llm-bench-")) / "model"
    if not (model_dir / "config.json").is_file():
        build_benchmark_llm(model_dir)
    requests_n = 8 if args.quick else args.requests
    args.rounds = 1 if args.quick else max(1, args.rounds)
    prompt_range, out_range = ((16, 64), (8, 32)) if args.quick else ((16, 256), (8, 256))
    model = load_hf(model_dir)
    vocab, pad = model.config.vocab_size, model.config.pad_token_id
    work = workload(requests_n, args.seed, prompt_range, out_range, vocab)
    config = EngineConfig(
        kv_cache_bytes=512 * 2**20,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    engine = make_engine(model_dir, config)

    phases: list[Phase] = []
    hf_outputs: list[list[int]] | None = None
    plain_outputs: list[list[int]] | None = None
    prefix: dict[str, float] | None = None
    waste: dict[str, float] | None = None
    steps = [
        "hf_one_at_a_time",
        "hf_static_batching",
        "hf_generate_batch",
        "engine_torch_attention",
        "engine_transformers",
        "engine",
        "engine_int8",
        "engine_c1",
        "engine_transformers_c1",
        "engine_int8_c1",
        "ttft",
    ]
    # Interleaved rounds: each phase once a round, so a slow spell of a shared machine hits
    # every phase alike; one request at a time (minutes) and TTFT run in the first only.
    once = {"hf_one_at_a_time", "ttft"}
    plan = [
        step
        for r in range(args.rounds)
        for step in steps
        if step not in args.skip and (r == 0 or step not in once)
    ]
    plain = make_engine(model_dir, config, native_decode=False)
    modules = make_engine(model_dir, replace(config, fused_step=False))
    int8 = make_engine(model_dir, config, quantization="int8")
    c1_work = work[: 2 if args.quick else args.c1_requests]
    runs: dict[str, list[Phase]] = {}
    for step in tqdm(plan, desc="phases"):
        cpu_start = time.process_time()
        if step == "hf_one_at_a_time":
            phase, hf_outputs = hf_one_at_a_time(model, work, pad)
        elif step == "hf_static_batching":
            phase = hf_static_batching(model, work, pad, args.static_batch_size)
        elif step == "hf_generate_batch":
            phase = hf_generate_batch(model, work, pad)
        elif step == "engine_torch_attention":
            phase, plain_outputs, _ = engine_throughput(plain, work, step)
        elif step == "engine_transformers":
            phase, _, _ = engine_throughput(modules, work, step)
        elif step == "engine":
            phase, engine_outputs, engine_waste = engine_throughput(engine, work)
            waste = waste or engine_waste
        elif step == "engine_int8":
            phase, int8_outputs, _ = engine_throughput(int8, work, step)
        elif step in ("engine_c1", "engine_transformers_c1", "engine_int8_c1"):
            one = {"engine_c1": engine, "engine_transformers_c1": modules, "engine_int8_c1": int8}
            phase = engine_one_at_a_time(one[step], c1_work, step)
        else:
            prefix = prefix_ttft(engine, vocab, 512, 2 if args.quick else 5)
            continue
        phase.cpu_seconds = time.process_time() - cpu_start
        runs.setdefault(step, []).append(phase)
        tqdm.write(
            f"{phase.name}: {phase.output_tokens} tokens in {phase.seconds:.1f}s "
            f"= {phase.tokens_per_s:.1f} tok/s ({phase.tokens_per_cpu_s:.1f} per CPU-second)"
        )
    phases = [
        Phase(
            name,
            rounds[0].requests,
            rounds[0].output_tokens,
            statistics.median(p.seconds for p in rounds),
            statistics.median(p.cpu_seconds for p in rounds),
            [p.seconds for p in rounds],
        )
        for name, rounds in runs.items()
    ]

    by_name = {p.name: p for p in phases}
    # The engine is plotted last, beside what it is compared with.
    phases = [p for p in phases if p.name != "engine"] + [by_name["engine"]]
    ours = by_name["engine"].tokens_per_s
    results: dict[str, Any] = {
        "model": f"Llama {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M fp32",
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "rounds": args.rounds,
        "workload": {
            "requests": requests_n,
            "prompt_tokens": prompt_range,
            "max_tokens": out_range,
            "seed": args.seed,
            "static_batch_size": args.static_batch_size,
        },
        "engine_config": asdict(config),
        "phases": [
            {**asdict(p), "tokens_per_s": p.tokens_per_s, "tokens_per_cpu_s": p.tokens_per_cpu_s}
            for p in phases
        ],
        "engine_speedup": {
            name: ours / p.tokens_per_s for name, p in by_name.items() if name != "engine"
        },
        "engine_speedup_cpu_time": {
            name: by_name["engine"].tokens_per_cpu_s / p.tokens_per_cpu_s
            for name, p in by_name.items()
            if name != "engine" and p.cpu_seconds
        },
        "kv_cache": waste,
        "prefix_cache": prefix,
    }
    flops = workload_flops(model, [(len(r.prompt), r.max_tokens) for r in work])
    whole = {p.name: p.seconds for p in phases if p.requests == len(work)}
    results["roofline"] = {
        **roofline(flops["total"], gemm_peak_gflops(), whole),
        "workload_gflop_by_part": {k: round(v / 1e9, 1) for k, v in flops.items()},
    }
    if "engine_int8" in runs:
        results["int8_vs_fp32"] = int8_ratios(runs, int8_outputs, engine_outputs)
    if hf_outputs is not None:
        results["engine_equals_hf_greedy"] = sum(
            a == b for a, b in zip(engine_outputs, hf_outputs, strict=True)
        )
    if plain_outputs is not None:
        results["engine_equals_torch_attention_greedy"] = sum(
            a == b for a, b in zip(engine_outputs, plain_outputs, strict=True)
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    keys = ("engine_speedup", "engine_speedup_cpu_time", "kv_cache", "prefix_cache", "roofline")
    keys += ("int8_vs_fp32",) if "int8_vs_fp32" in results else ()
    print(json.dumps({k: results[k] for k in keys}, indent=2))


if __name__ == "__main__":
    main()
