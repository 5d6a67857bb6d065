"""LoRA adapters on the LLM engine: mixed-adapter throughput and adapter load times.

Side by side in one run, on the ~25M-parameter benchmark Llama (float32) with PEFT adapters
built on the spot (random A and B; rank `--rank`, every linear layer of every decoder layer):

- Throughput: the same 64 requests (prompts 16-128 tokens, new ones each round, `--max-tokens`
  each, greedy, ignore_eos) spread round-robin over 8 adapters, against all 64 on the base
  alone in an engine with no adapter loaded. Each round runs both, in alternating order;
  the figures are medians of the per-round ratios of generated tokens per second of wall
  time and per second of the process's CPU time (the steadier one on a shared machine:
  other jobs' load stretches wall time, not the CPU time our work takes); goal >= 0.7x.
- Load time: `LLMBackend.load_adapter` (read, check against the base, host copy), and the
  restore of an evicted adapter from host memory into a device slot, against loading the
  merged model (PEFT's `merge_and_unload`, saved as safetensors) as a separate model with
  `LLMBackend.load`; goal >= 20x faster.

    python benchmarks/lora.py [--rounds 3] [--max-tokens 32] [--rank 16] [--threads 1]

Results: benchmarks/results/lora.json and lora.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from backends.base import BackendContext  # noqa: E402
from backends.llm.backend import LLMBackend  # noqa: E402
from backends.llm.config import EngineConfig  # noqa: E402
from backends.llm.engine import LLMEngine  # noqa: E402
from backends.llm.lora import read_adapter  # noqa: E402
from backends.llm.model_runner import ModelRunner  # noqa: E402
from backends.llm.sampling_params import SamplingParams  # noqa: E402
from backends.tiny import build_benchmark_llm  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
GOALS = {"throughput_ratio": 0.7, "load_speedup": 20.0}
NUM_REQUESTS = 64
NUM_ADAPTERS = 8
KV_CACHE_BYTES = 256 * 2**20


def build_adapters(base: Path, root: Path, rank: int) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folders = []
    for i in range(NUM_ADAPTERS):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        torch.manual_seed(i)
        config = LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False
        )
        folder = root / f"adapter-{i}"
        get_peft_model(model, config).save_pretrained(str(folder))
        folders.append(folder)
    return folders


def build_merged(base: Path, adapter: Path, out: Path) -> Path:
    """The base with `adapter` merged in (PEFT), saved as a model folder of its own."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    for name in os.listdir(base):  # tokenizer files
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(base / name, out / name)
    return out


def workload(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(7, 8000) for _ in range(rng.randint(16, 128))] for _ in range(64)]


def engine_for(base: Path, adapters: list[Path]) -> LLMEngine:
    config = EngineConfig(kv_cache_bytes=KV_CACHE_BYTES, max_num_seqs=NUM_REQUESTS)
    runner = ModelRunner.load(base, "cpu", torch.float32, config)
    for i, folder in enumerate(adapters):
        runner.lora.add(f"adapter-{i}", read_adapter(folder))
    return LLMEngine(config, runner, None)


def run(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, lora: bool
) -> tuple[float, float]:
    """Generated tokens per second of wall time and of CPU time, all `prompts` at once."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    for i, prompt in enumerate(prompts):
        adapter = f"adapter-{i % NUM_ADAPTERS}" if lora else None
        engine.add_request(f"{lora}-{i}-{start}", prompt, params, adapter=adapter)
    generated = 0
    while engine.has_work():
        generated += len(engine.step())
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return generated / wall, generated / cpu


def bench_throughput(
    base: Path, adapters: list[Path], rounds: int, max_tokens: int, tick: Callable[[], None]
) -> dict[str, Any]:
    plain, mixed = engine_for(base, []), engine_for(base, adapters)
    warm_up = workload(seed=10_000)[:8]  # first-call costs out of the timings
    run(plain, warm_up, 4, False)
    run(mixed, warm_up, 4, True)
    tok_s: dict[str, list[float]] = {"base": [], "adapters": []}
    cpu_tok_s: dict[str, list[float]] = {"base": [], "adapters": []}
    for r in range(rounds):
        prompts = workload(seed=r)  # fresh prompts: no prefix hit from an earlier round
        sides = [("base", plain, False), ("adapters", mixed, True)]
        for name, engine, lora in sides if r % 2 == 0 else sides[::-1]:
            wall, cpu = run(engine, prompts, max_tokens, lora)
            tok_s[name].append(wall)
            cpu_tok_s[name].append(cpu)
            tick()
    ratios = [a / b for a, b in zip(tok_s["adapters"], tok_s["base"], strict=True)]
    cpu_ratios = [a / b for a, b in zip(cpu_tok_s["adapters"], cpu_tok_s["base"], strict=True)]
    return {
        "tokens_per_s": tok_s,
        "tokens_per_cpu_s": cpu_tok_s,
        "median_tokens_per_s": {k: statistics.median(v) for k, v in tok_s.items()},
        "median_tokens_per_cpu_s": {k: statistics.median(v) for k, v in cpu_tok_s.items()},
        "ratios": ratios,
        "cpu_ratios": cpu_ratios,
        "ratio": statistics.median(ratios),
        "cpu_ratio": statistics.median(cpu_ratios),
        "requests": NUM_REQUESTS,
        "adapters": NUM_ADAPTERS,
        "max_tokens": max_tokens,
    }


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_loads(
    base: Path, adapters: list[Path], merged: Path, runs: int, tick: Callable[[], None]
) -> dict[str, Any]:
    config = {"kv_cache_bytes": KV_CACHE_BYTES}
    backend = LLMBackend(BackendContext("base", "1", config))
    backend.load(base, "cpu", torch.float32)
    lora = backend.engine.runner.lora
    seconds: dict[str, list[float]] = {"load_adapter": [], "slot_restore": [], "merged_load": []}
    device_bytes = 0
    for i in range(runs):
        key = f"a{i}"
        seconds["load_adapter"].append(timed(partial(backend.load_adapter, key, adapters[0])))
        lora.ensure_resident([key])
        lora.evict(key)
        seconds["slot_restore"].append(timed(partial(lora.ensure_resident, [key])))
        device_bytes = backend.loaded_adapters()[key]
        backend.unload_adapter(key)
        tick()
    backend.unload()
    for _ in range(runs):
        other = LLMBackend(BackendContext("merged", "1", config))
        seconds["merged_load"].append(timed(partial(other.load, merged, "cpu", torch.float32)))
        other.unload()
        tick()
    medians = {k: statistics.median(v) for k, v in seconds.items()}
    return {
        "seconds": seconds,
        "median_s": medians,
        "speedup_load_adapter": medians["merged_load"] / medians["load_adapter"],
        "speedup_slot_restore": medians["merged_load"] / medians["slot_restore"],
        "adapter_file_bytes": (adapters[0] / "adapter_model.safetensors").stat().st_size,
        "adapter_device_bytes": device_bytes,
        "merged_file_bytes": sum(p.stat().st_size for p in merged.glob("*.safetensors")),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tp, loads = result["throughput"], result["loads"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    labels = ["base alone", f"{NUM_ADAPTERS} adapters mixed"]
    width = 0.38
    for offset, key, name, color in (
        (-width / 2, "median_tokens_per_s", "per wall second", ["#9aa5b1", "#3b6fd8"]),
        (width / 2, "median_tokens_per_cpu_s", "per CPU second", ["#c4cbd3", "#8fb0f0"]),
    ):
        values = [tp[key]["base"], tp[key]["adapters"]]
        xs = [i + offset for i in range(2)]
        left.bar(xs, values, width, color=color, label=name)
        for x, v in zip(xs, values, strict=True):
            left.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    left.set_xticks(range(2), labels)
    left.legend(fontsize=8)
    left.set_title(
        f"{NUM_REQUESTS} requests: adapters / base = {tp['ratio']:.2f}x wall, "
        f"{tp['cpu_ratio']:.2f}x CPU (goal >= {GOALS['throughput_ratio']}x)",
        fontsize=9.5,
    )
    left.set_ylabel("generated tokens per second (median)")
    keys = ["load_adapter", "slot_restore", "merged_load"]
    ms = [loads["median_s"][k] * 1000 for k in keys]
    right.bar(
        ["load_adapter", "restore into\na slot", "merged model\nLLMBackend.load"],
        ms,
        color=["#3b6fd8", "#6c9be8", "#c9a227"],
    )
    right.set_yscale("log")
    for i, v in enumerate(ms):
        right.text(i, v, f"{v:.2f} ms", ha="center", va="bottom", fontsize=9)
    right.set_title(
        f"Load: merged / load_adapter = {loads['speedup_load_adapter']:.0f}x "
        f"(goal >= {GOALS['load_speedup']:.0f}x)",
        fontsize=9.5,
    )
    right.set_ylabel("milliseconds (median, log scale)")
    fig.suptitle(
        f"LoRA on a {result['model']['parameters'] / 1e6:.0f}M Llama, rank {result['rank']} "
        f"on every linear layer, {result['machine']['cpu_threads']} CPU threads",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds (each side)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--load-runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from tqdm import tqdm

    with tempfile.TemporaryDirectory(prefix="hub-lora-") as tmp:
        root = Path(tmp)
        base = build_benchmark_llm(root / "llama")
        adapters = build_adapters(base, root, args.rank)
        merged = build_merged(base, adapters[0], root / "merged")
        probe = ModelRunner.load(base, "cpu", torch.float32, EngineConfig(kv_cache_bytes=2**20))
        parameters = sum(p.numel() for p in probe.model.parameters())
        del probe
        total = 2 * args.rounds + 2 * args.load_runs
        with tqdm(total=total, desc="lora benchmark", unit="run") as bar:
            throughput = bench_throughput(base, adapters, args.rounds, args.max_tokens, bar.update)
            loads = bench_loads(base, adapters, merged, args.load_runs, bar.update)
    result = {
        "benchmark": "lora",
        "device": "cpu",
        "rank": args.rank,
        "model": {"parameters": parameters, "dtype": "float32"},
        "throughput": throughput,
        "loads": loads,
        "goals": GOALS,
        "meets_goals": {
            "throughput": throughput["ratio"] >= GOALS["throughput_ratio"],
            "throughput_cpu": throughput["cpu_ratio"] >= GOALS["throughput_ratio"],
            "load": loads["speedup_load_adapter"] >= GOALS["load_speedup"],
        },
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_threads": torch.get_num_threads(),
            "load_average": os.getloadavg(),
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lora.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "lora.png")
    tp = throughput["median_tokens_per_s"]
    ms = {k: v * 1000 for k, v in loads["median_s"].items()}
    print(
        f"throughput: {tp['adapters']:.0f} tok/s with {NUM_ADAPTERS} adapters vs {tp['base']:.0f} "
        f"on the base: {throughput['ratio']:.2f}x wall, {throughput['cpu_ratio']:.2f}x CPU "
        f"(goal {GOALS['throughput_ratio']}x); "
        f"load_adapter {ms['load_adapter']:.2f} ms, slot restore {ms['slot_restore']:.3f} ms, "
        f"merged model load {ms['merged_load']:.0f} ms: {loads['speedup_load_adapter']:.0f}x "
        f"(goal {GOALS['load_speedup']:.0f}x) -> {args.out / 'lora'}.json, .png"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
