"""One stream at a time over HTTP: inter-token latency, time to first token and tokens/s of
the hub's LLM engine, this tree against another checkout (`--baseline`), side by side.

Each tree runs as a real `hub serve` process (its own code on PYTHONPATH) serving the
benchmark Llama (~26M parameters, float32, random weights) through `/v1/completions` with
`stream: true`, as an OpenAI client would. Per round and tree, in interleaved order:

- concurrency 1: `--c1-requests` requests one after the other, each a `--prompt-tokens`
  prompt generating exactly `--max-tokens` tokens (greedy, EOS ignored); the gaps between
  a stream's events give the inter-token latency (`tokens_per_event` says how many tokens
  an event carried on average: 1 when each token is sent as it comes), the first event the
  time to first token;
- concurrency 64: the `llm_throughput.py` workload (64 requests, prompts 16-256 tokens,
  8-256 output tokens, seed 0) sent at once; output tokens/s.

Medians over rounds, and the ratio this tree / baseline of each round's figures. Results go
to `benchmarks/results/llm_stream_latency.json` and `.png`.

    python benchmarks/llm_stream_latency.py [--baseline DIR] [--rounds 3] [--quick]

DIR is another checkout of this repository (e.g. `git archive main | tar -x -C DIR`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.launch.process import hub_config, hub_process  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"
MODEL = "bench-llm"
# Token ids below this are the tokenizer's special tokens; prompts avoid them.
FIRST_PLAIN_TOKEN = 7
VOCAB = 8192


def _hub_config(root: Path, source: Path) -> Path:
    model = {"name": MODEL, "kind": "llm", "source": str(source), "preload": True,
             "config": {"kv_cache_bytes": "512MiB", "max_num_seqs": 64}}  # fmt: skip
    return hub_config(root, [model])


@contextmanager
def hub_server(root: Path, source: Path, tree: Path) -> Iterator[str]:
    """`hub serve` running `tree`'s code with the model loaded; yields its base URL."""
    import httpx

    root.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONPATH": str(tree)}
    with hub_process(_hub_config(root, source), cwd=root, env=env, timeout=300) as (base, _):
        deadline = time.monotonic() + 300
        body = {"model": MODEL, "prompt": [FIRST_PLAIN_TOKEN] * 8, "max_tokens": 2}
        while True:  # ready, then serving: the preloaded model answers
            try:
                if httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{tree}: the hub does not serve {MODEL}")
            time.sleep(0.5)
        yield base


async def stream_one(session: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion; its event times and token count."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    times: list[float] = []
    tokens = 0
    async with session.post("/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                times.append(time.perf_counter())
            elif event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return {"start": start, "times": times, "tokens": tokens}


async def concurrency_1(base: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    import aiohttp

    gaps: list[float] = []
    ttfts: list[float] = []
    tokens = events = 0
    elapsed = 0.0
    async with aiohttp.ClientSession(base) as session:
        await stream_one(session, prompts[0][:8], 4)  # the connection is open
        for prompt in prompts:
            s = await stream_one(session, prompt, max_tokens)
            times = s["times"]
            ttfts.append(times[0] - s["start"])
            gaps.extend(b - a for a, b in itertools.pairwise(times))
            events += len(times)
            tokens += s["tokens"]
            elapsed += times[-1] - s["start"]
    return {
        "itl_p50_ms": 1000 * statistics.median(gaps),
        "itl_p90_ms": 1000 * statistics.quantiles(gaps, n=10)[-1],
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "tokens_per_s": tokens / elapsed,
        "tokens": tokens,
        # Above 1 when events carry several tokens (an event's gap is then its tokens').
        "tokens_per_event": tokens / events,
    }


async def concurrency_n(base: str, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=len(work))
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(base, connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        streams = await asyncio.gather(*(stream_one(session, p, m) for p, m in work))
        elapsed = time.perf_counter() - start
    tokens = sum(s["tokens"] for s in streams)
    return {"tokens_per_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed}


def workload(count: int, seed: int, prompt_range: tuple[int, int], out_range: tuple[int, int]):
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(FIRST_PLAIN_TOKEN, VOCAB) for _ in range(rng.randint(*prompt_range))],
            rng.randint(*out_range),
        )
        for _ in range(count)
    ]


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trees = list(report["medians"])
    panels = [
        ("itl_p50_ms", "concurrency 1: inter-token latency p50 (ms)"),
        ("ttft_p50_ms", "concurrency 1: time to first token p50 (ms)"),
        ("c1_tokens_per_s", "concurrency 1: output tokens/s"),
        ("c64_tokens_per_s", "concurrency 64: output tokens/s"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4))
    for ax, (key, title) in zip(axes, panels, strict=True):
        values = [report["medians"][t].get(key, 0.0) for t in trees]
        bars = ax.bar(trees, values, color=["#999999", "#1f77b4"][-len(trees) :])
        ax.bar_label(bars, fmt="%.1f")
        ax.set_title(title, fontsize=9)
    fig.suptitle(f"{report['model']} over HTTP (SSE), medians of {report['rounds']} rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with")
    parser.add_argument("--model-dir", type=Path, help="reuse (or build into) this folder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--c1-requests", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=64, help="of the concurrent phase")
    parser.add_argument("--skip-concurrent", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a small run (smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS / "llm_stream_latency.json")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.c1_requests, args.max_tokens, args.requests = 1, 2, 32, 8
    from backends.tiny import build_benchmark_llm

    root = Path(tempfile.mkdtemp(prefix="llm-stream-"))
    model_dir = args.model_dir or root / "model"
    if not (model_dir / "config.json").is_file():
        build_benchmark_llm(model_dir)
    rng = random.Random(1)
    c1_prompts = [
        [rng.randrange(FIRST_PLAIN_TOKEN, VOCAB) for _ in range(args.prompt_tokens)]
        for _ in range(args.c1_requests)
    ]
    work = workload(args.requests, 0, (16, 256), (8, 256))
    trees = {"this_tree": REPO_ROOT}
    if args.baseline is not None:
        trees = {"baseline": args.baseline.resolve(), **trees}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    with ExitStack() as stack:
        bases = {
            name: stack.enter_context(hub_server(root / name, model_dir, tree))
            for name, tree in trees.items()
        }
        names = list(trees)
        # Interleaved, and alternating which tree goes first in a round.
        plan = [(r, n) for r in range(args.rounds) for n in (names if r % 2 == 0 else names[::-1])]
        for r, name in tqdm(plan, desc="rounds x trees"):
            base = bases[name]
            result = {"round": r, **asyncio.run(concurrency_1(base, c1_prompts, args.max_tokens))}
            if not args.skip_concurrent:
                result["c64"] = asyncio.run(concurrency_n(base, work))
            runs[name].append(result)
            tqdm.write(f"{name} round {r}: {json.dumps(result)}")

    def medians(rounds: list[dict[str, Any]]) -> dict[str, float]:
        out = {
            "itl_p50_ms": statistics.median(x["itl_p50_ms"] for x in rounds),
            "ttft_p50_ms": statistics.median(x["ttft_p50_ms"] for x in rounds),
            "c1_tokens_per_s": statistics.median(x["tokens_per_s"] for x in rounds),
        }
        if not args.skip_concurrent:
            out["c64_tokens_per_s"] = statistics.median(x["c64"]["tokens_per_s"] for x in rounds)
        return out

    report: dict[str, Any] = {
        "model": "Llama 26M fp32",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average": os.getloadavg(),
        },
        "rounds": args.rounds,
        "c1": {"requests": args.c1_requests, "prompt_tokens": args.prompt_tokens,
               "max_tokens": args.max_tokens},
        "concurrent": {"requests": args.requests, "prompt_tokens": [16, 256],
                       "max_tokens": [8, 256]},
        "trees": {name: str(tree) for name, tree in trees.items()},
        "runs": runs,
        "medians": {name: medians(rounds) for name, rounds in runs.items()},
    }  # fmt: skip
    if "baseline" in runs:
        pairs = list(zip(runs["baseline"], runs["this_tree"], strict=True))
        ratios = {
            "itl_p50": [n["itl_p50_ms"] / b["itl_p50_ms"] for b, n in pairs],
            "ttft_p50": [n["ttft_p50_ms"] / b["ttft_p50_ms"] for b, n in pairs],
            "c1_tokens_per_s": [n["tokens_per_s"] / b["tokens_per_s"] for b, n in pairs],
        }
        if not args.skip_concurrent:
            ratios["c64_tokens_per_s"] = [
                n["c64"]["tokens_per_s"] / b["c64"]["tokens_per_s"] for b, n in pairs
            ]
        report["ratio_this_tree_to_baseline"] = {
            k: {"median": statistics.median(v), "rounds": v} for k, v in ratios.items()
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    keys = ("medians", "ratio_this_tree_to_baseline")
    print(json.dumps({k: report[k] for k in keys if k in report}, indent=2))


if __name__ == "__main__":
    main()
