"""Embedding throughput: the hub over HTTP against sentence-transformers in-process.

One run measures, side by side on the same sentences and the same machine:

  * `encode` one sentence at a time, in this process (what a plain wrapper manages);
  * `encode` in large batches, in this process: the ceiling, no HTTP at all;
  * a real `hub serve` process serving all-MiniLM-L6-v2, driven from this process (a separate
    one, so the two do not share a GIL) by an asyncio HTTP client sending one sentence per
    request at each concurrency, as the openai client sends it (`encoding_format` base64).

HTTP, JSON and the client share the machine's cores with the model, as they would in a real
deployment on one box. Each configuration runs `--rounds` times, interleaved, and the best
round counts (other tenants only ever slow a round down). Results go to
`benchmarks/results/embed_throughput.json` and `.png`.

    python benchmarks/embed_throughput.py            # the full run
    python benchmarks/embed_throughput.py --quick    # a smoke run in about a minute
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python benchmarks/<name>.py` from anywhere
    sys.path.insert(0, str(REPO))

from benchmarks.launch.process import hub_config, hub_process, read_log  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
MODEL = "minilm"

# Sentences of mixed length (6 to 30 words, ~8 to 40 tokens), as short texts and queries are.
_VOCABULARY = (
    "the a of to and in is for on that with as was by at from it this be are an or his her "
    "which one all were when we there can more would their if has been time who its out no "
    "what about up said into some them could than other these two then may first only any "
    "model memory request batch token cache server query answer document search harbour "
    "ferry morning evening weather market price river mountain village music library garden "
    "kitchen window doctor teacher student engine network signal budget schedule journey"
)
_WORDS = _VOCABULARY.split()


def make_sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.choices(_WORDS, k=rng.randint(6, 30))
        out.append(" ".join(words).capitalize() + ".")
    return out


# ---- in-process baselines -------------------------------------------------------------------
def encode_one_at_a_time(model: Any, sentences: list[str]) -> dict[str, float]:
    start, cpu = time.perf_counter(), time.process_time()
    for s in sentences:
        model.encode(s)
    return _rate(len(sentences), time.perf_counter() - start, time.process_time() - cpu)


def encode_batched(model: Any, sentences: list[str], batch_size: int) -> dict[str, float]:
    start, cpu = time.perf_counter(), time.process_time()
    model.encode(sentences, batch_size=batch_size)
    rate = _rate(len(sentences), time.perf_counter() - start, time.process_time() - cpu)
    return {**rate, "batch_size": batch_size}


def _rate(n: int, seconds: float, cpu_seconds: float) -> dict[str, float]:
    # CPU time per sentence is a second view, less sensitive to other tenants than wall time.
    return {"rps": n / seconds, "seconds": seconds, "sentences": n,
            "cpu_ms_per_sentence": 1000 * cpu_seconds / n}  # fmt: skip


def batch_totals(base: str) -> dict[str, float]:
    """The hub's own batching counters for the benchmarked model, from /metrics."""
    import httpx

    wanted = {
        "hub_batch_size_count": "batches",
        "hub_batch_size_sum": "inputs",
        "hub_batch_tokens_sum": "tokens",
        "hub_batch_padded_tokens_sum": "padded_tokens",
    }
    totals = dict.fromkeys(wanted.values(), 0.0)
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        name, _, rest = line.partition("{")
        if name in wanted and f'model="{MODEL}"' in rest:
            totals[wanted[name]] += float(line.rsplit(" ", 1)[1])
    return totals


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process and its live descendants (the
    encoders' forward workers) have used."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for process in (root, *root.children(recursive=True)):
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


# ---- the hub as a real process --------------------------------------------------------------
def _hub_config(root: Path, source: str, runtime_config: dict[str, Any]) -> Path:
    model = {"name": MODEL, "kind": "embedder", "source": source, "preload": True,
             "config": runtime_config}  # fmt: skip
    return hub_config(root, [model])


@contextmanager
def hub_server(
    root: Path, source: str, runtime_config: dict[str, Any], env: dict[str, str]
) -> Iterator[tuple[str, int]]:
    """`hub serve` with the model registered and loaded; yields its base URL and process id."""
    import httpx

    config = _hub_config(root, source, runtime_config)
    with hub_process(config, cwd=root, env=env, timeout=300) as (base, proc):
        deadline = time.monotonic() + 300
        while True:  # ready, then serving: the preloaded model answers
            try:
                r = httpx.post(f"{base}/v1/embeddings", json={"model": MODEL, "input": "warm"},
                               timeout=30)  # fmt: skip
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                logs = "\n".join(read_log(str(p)) for p in root.glob("hub-*.log"))
                raise TimeoutError(f"hub not serving:\n{logs}")
            time.sleep(0.5)
        yield base, proc.pid


async def drive(
    base: str,
    server_pid: int,
    sentences: list[str],
    concurrency: int,
    requests: int,
    encoding_format: str,
) -> dict[str, float]:
    """`requests` POSTs of one sentence each from `concurrency` workers; throughput, latency."""
    import aiohttp

    bodies = [
        json.dumps({"model": MODEL, "input": s, "encoding_format": encoding_format}).encode()
        for s in sentences
    ]
    latencies: list[float] = []
    errors = 0
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(base, connector=connector) as session:

        async def worker(ids: Iterator[int]) -> None:
            nonlocal errors
            for i in ids:  # the workers share one iterator: `requests` in all
                start = time.perf_counter()
                async with session.post("/v1/embeddings", data=bodies[i % len(bodies)],
                                        headers=headers) as r:  # fmt: skip
                    payload = await r.read()
                    if r.status != 200:
                        errors += 1
                        continue
                json.loads(payload)  # a client reads what it asked for
                latencies.append(time.perf_counter() - start)

        # A few requests per worker first: connections open, the pipeline is warm.
        warm = iter(range(2 * concurrency))
        await asyncio.gather(*(worker(warm) for _ in range(concurrency)))
        latencies.clear()
        ids = iter(range(requests))
        before = batch_totals(base)
        server_cpu, client_cpu = process_cpu_seconds(server_pid), time.process_time()
        start = time.perf_counter()
        await asyncio.gather(*(worker(ids) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
        client_cpu = time.process_time() - client_cpu
        server_cpu = process_cpu_seconds(server_pid) - server_cpu
        after = batch_totals(base)
    latencies.sort()
    done = len(latencies)
    return {
        "concurrency": concurrency,
        "requests": done,
        "errors": errors,
        "rps": done / elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(done - 1, int(0.99 * done))],
        "server_cpu_ms_per_request": 1000 * server_cpu / done,
        "client_cpu_ms_per_request": 1000 * client_cpu / done,
        # How the hub batched these requests: mean inputs per forward pass, and padded tokens
        # per real token.
        "mean_batch_size": (after["inputs"] - before["inputs"])
        / max(1.0, after["batches"] - before["batches"]),
        "padding_ratio": (after["padded_tokens"] - before["padded_tokens"])
        / max(1.0, after["tokens"] - before["tokens"]),
    }


# ---- report ---------------------------------------------------------------------------------
def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hub = report["hub"]
    levels = [str(h["concurrency"]) for h in hub]
    ceiling = report["baselines"]["encode_batched"]["rps"]
    single = report["baselines"]["encode_one_at_a_time"]["rps"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 5.4))
    bars = left.bar(levels, [h["rps"] for h in hub], color="#4c72b0", label="hub over HTTP")
    for bar, h in zip(bars, hub, strict=True):
        left.annotate(f"{h['ratio_to_ceiling']:.2f}x", (bar.get_x() + bar.get_width() / 2,
                      bar.get_height()), ha="center", va="bottom", fontsize=9)  # fmt: skip
    left.axhline(ceiling, color="#c44e52", label=f"encode, batched (ceiling) {ceiling:.0f}/s")
    left.axhline(0.8 * ceiling, color="#c44e52", linestyle=":", label="0.8x ceiling (goal)")
    bound = report["baselines"]["two_core_bound_rps"]
    left.axhline(bound, color="#8c8c8c", linestyle="-.",
                 label=f"2 x encode batched on one thread {bound:.0f}/s")  # fmt: skip
    left.axhline(single, color="#55a868", linestyle="--",
                 label=f"encode, one at a time {single:.0f}/s")  # fmt: skip
    left.set_xlabel("concurrent HTTP clients (one sentence per request)")
    left.set_ylabel("sentences / s")
    left.set_title(f"Throughput, {report['model']}")
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    right.plot(levels, [h["p50_ms"] for h in hub], marker="o", label="p50")
    right.plot(levels, [h["p99_ms"] for h in hub], marker="o", label="p99")
    right.set_xlabel("concurrent HTTP clients")
    right.set_ylabel("latency per request (ms)")
    right.set_title("Latency")
    right.legend()
    load = ", ".join(f"{x:.1f}" for x in report["machine"]["load_average"])
    fig.suptitle(f"{report['machine']['summary']}; load average at the end {load}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts, one round")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--requests", type=int, help="HTTP requests per concurrency level")
    parser.add_argument("--rounds", type=int, help="repeat everything; the best round counts")
    parser.add_argument("--encoding-format", choices=["base64", "float"], default="base64")
    parser.add_argument("--batch-size", type=int, default=128, help="batch of the ceiling")
    parser.add_argument("--runtime-config", type=json.loads, default={},
                        help="the model's hub runtime config as JSON, e.g. "
                             '\'{"max_batch_size": 32}\'')  # fmt: skip
    parser.add_argument("--server-env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="environment of the hub process (e.g. OMP_NUM_THREADS=2)")  # fmt: skip
    parser.add_argument(
        "--source",
        default="builtin:minilm",
        help="the embedder: builtin:minilm or a sentence-transformers folder",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    requests = args.requests or (150 if args.quick else 600)
    rounds = args.rounds or (1 if args.quick else 3)

    import torch
    from sentence_transformers import SentenceTransformer
    from tqdm import tqdm

    from hub.demo import is_builtin, materialise_builtin

    sentences = make_sentences(2048)
    folder = args.source
    if is_builtin(folder):
        folder = str(materialise_builtin(folder, Path(tempfile.gettempdir()) / "hub-bench-demo"))
    model = SentenceTransformer(folder, device="cpu")
    tokens = [len(ids) for ids in model.tokenizer(sentences)["input_ids"]]
    model.encode(sentences[:256], batch_size=64)  # warm-up
    single_n = 100 if args.quick else 150
    batched = sentences[:512] if args.quick else sentences
    server_env = dict(kv.split("=", 1) for kv in args.server_env)

    runs: dict[str, list[dict[str, float]]] = {"single": [], "batched": [], "one_thread": []}
    hub_runs: dict[int, list[dict[str, float]]] = {c: [] for c in args.concurrency}
    steps = rounds * (3 + len(args.concurrency))
    threads = torch.get_num_threads()
    with (
        tempfile.TemporaryDirectory(prefix="embed-bench-") as tmp,
        tqdm(total=steps) as bar,
        hub_server(Path(tmp), args.source, args.runtime_config, server_env) as (base, pid),
    ):
        for _ in range(rounds):
            bar.set_description("encode, one at a time")
            runs["single"].append(encode_one_at_a_time(model, sentences[:single_n]))
            bar.update()
            bar.set_description("encode, batched")
            runs["batched"].append(encode_batched(model, batched, args.batch_size))
            bar.update()
            # The same on one thread: twice it bounds what two cores can do with no
            # threading overhead at all, a steadier reference on a busy machine.
            bar.set_description("encode, batched, one thread")
            torch.set_num_threads(1)
            runs["one_thread"].append(encode_batched(model, batched[:256], args.batch_size))
            torch.set_num_threads(threads)
            bar.update()
            for c in args.concurrency:
                bar.set_description(f"hub, concurrency {c}")
                n = max(requests, 4 * c)
                result = asyncio.run(drive(base, pid, sentences, c, n, args.encoding_format))
                hub_runs[c].append(result)
                bar.update()

    def best(results: list[dict[str, float]]) -> dict[str, Any]:
        chosen = max(results, key=lambda r: r["rps"])
        return {**chosen, "all_rounds_rps": [r["rps"] for r in results]}

    ceiling = best(runs["batched"])["rps"]
    bound = 2 * best(runs["one_thread"])["rps"]
    hub = []
    for c in args.concurrency:
        chosen = best(hub_runs[c])
        hub.append({**chosen, "ratio_to_ceiling": chosen["rps"] / ceiling,
                    "ratio_to_two_core_bound": chosen["rps"] / bound})  # fmt: skip
    cpus = os.cpu_count()
    report = {
        "benchmark": "embed_throughput",
        "model": args.source,
        "machine": {
            "cpus": cpus,
            "torch_threads": threads,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "load_average": os.getloadavg(),
            "summary": f"{cpus} CPUs, {platform.machine()}, torch {torch.__version__}; hub, "
            f"client and baselines share the machine",
        },
        "sentences": {
            "count": len(sentences),
            "mean_tokens": statistics.mean(tokens),
            "min_tokens": min(tokens),
            "max_tokens": max(tokens),
        },
        "settings": {
            "rounds": rounds,
            "requests_per_level": requests,
            "encoding_format": args.encoding_format,
            "runtime_config": args.runtime_config,
            "server_env": server_env,
            "quick": args.quick,
        },
        "baselines": {
            "encode_one_at_a_time": best(runs["single"]),
            "encode_batched": best(runs["batched"]),
            "encode_batched_one_thread": best(runs["one_thread"]),
            "two_core_bound_rps": bound,
        },
        "hub": hub,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "embed_throughput.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out / "embed_throughput.png")
    print_summary(report)
    print(f"wrote {args.out / 'embed_throughput.json'} and .png")


def print_summary(report: dict[str, Any]) -> None:
    base = report["baselines"]
    single, ceiling = base["encode_one_at_a_time"], base["encode_batched"]
    print(
        f"encode one at a time: {single['rps']:7.1f}/s  CPU {single['cpu_ms_per_sentence']:.1f}"
        " ms/sentence"
    )
    print(
        f"encode batched:       {ceiling['rps']:7.1f}/s  CPU {ceiling['cpu_ms_per_sentence']:.1f}"
        f" ms/sentence  (the ceiling, {ceiling['rps'] / single['rps']:.2f}x one at a time)"
    )
    print(f"two cores, no threading overhead (2x one thread): {base['two_core_bound_rps']:.1f}/s")
    for h in report["hub"]:
        print(f"hub c={h['concurrency']:<3} {h['rps']:7.1f}/s  {h['ratio_to_ceiling']:.2f}x ceiling"
              f"  p50 {h['p50_ms']:6.1f} ms  p99 {h['p99_ms']:6.1f} ms  CPU/request: server "
              f"{h['server_cpu_ms_per_request']:.1f} ms, client "
              f"{h['client_cpu_ms_per_request']:.2f} ms  batch {h['mean_batch_size']:.1f}, "
              f"padding {h['padding_ratio']:.2f}x  errors {h['errors']}")  # fmt: skip


if __name__ == "__main__":
    main()
