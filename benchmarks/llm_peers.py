"""LLM serving against the peers: the hub over HTTP, llama.cpp's `llama-server` and
`transformers serve`, on the same model, the same workload and the same two threads.

The model is the 26M benchmark Llama of `llm_throughput.py` (random weights, float32, built
on the spot; llama.cpp gets it converted to GGUF F32). The workload: 32 requests with prompts
of 16-256 tokens and outputs of 8-256 tokens (lengths from a fixed seed), greedy, each
generating exactly its output length (the hub: `max_tokens` + `ignore_eos`; llama.cpp:
`n_predict` + `ignore_eos`; transformers serve: a per-request generation config with no EOS
token). Every request streams (OpenAI's `/v1/completions` with `stream: true`, on each
server), at concurrency 1 (the first `--c1-requests` requests, one after the other), 8 and
32. Reported per server and concurrency: output tokens/s, time to first token and
inter-token latency (gaps between streamed events carrying text) at p50 and p99.

The prompts are token ids for the hub and llama.cpp and the same ids' text for transformers
serve (which takes text only); the text was chosen so that it tokenizes back to those ids.
Each round uses fresh prompt tokens (same lengths), so no server hits a prefix cached in an
earlier round. Servers run one at a time (two cores: they must not compete), in `--rounds`
interleaved rounds with the order rotated each round; medians of the rounds are reported,
with the hub's ratio to each peer taken per round. Results go to
`benchmarks/results/llm_peers.json` and `.png`; `--quick` is a smoke run.

    python benchmarks/llm_peers.py [--quick] [--rounds N] [--llama-server PATH]
        [--converter PATH] [--skip transformers]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python benchmarks/<name>.py` from anywhere
    sys.path.insert(0, str(REPO))

from benchmarks import peer_servers  # noqa: E402
from benchmarks.peer_servers import Endpoint, PeerMissing  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
CACHE = Path.home() / ".cache" / "model-hub" / "llm-peers"
SERVERS = ("hub", "llama.cpp", "transformers")


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    text: str
    max_tokens: int


@dataclass(frozen=True)
class Stream:
    """One streamed answer as the client saw it."""

    ttft: float
    gaps: list[float]
    events: int
    output_tokens: int
    text: str


def make_prompts(tokenizer: Any, lengths: list[int], seed: int) -> list[tuple[list[int], str]]:
    """Token ids of about each length, with a text that tokenizes back to exactly them."""
    rng = random.Random(seed)
    first = len(tokenizer.get_added_vocab())  # special and reserved tokens come first
    out = []
    for n in lengths:
        ids = [rng.randrange(first, len(tokenizer)) for _ in range(n)]
        text = str(tokenizer.decode(ids))
        # Decoded ids re-tokenize into other merges; cut the re-tokenized ids to the length
        # asked and settle on ids that round-trip through their text.
        for _ in range(5):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n]
            text = str(tokenizer.decode(ids))
            if tokenizer(text, add_special_tokens=False)["input_ids"] == ids:
                break
        out.append((tokenizer(text, add_special_tokens=False)["input_ids"], text))
    return out


def workload(tokenizer: Any, count: int, seed: int, rnd: int, quick: bool) -> list[Request]:
    rng = random.Random(seed)  # the lengths: the same every round
    prompt_range, out_range = ((16, 64), (8, 32)) if quick else ((16, 256), (8, 256))
    lengths = [(rng.randint(*prompt_range), rng.randint(*out_range)) for _ in range(count)]
    # Fresh prompt tokens each round, so nothing is a prefix hit from an earlier round.
    prompts = make_prompts(tokenizer, [p for p, _ in lengths], seed * 1000 + rnd + 1)
    return [Request(ids, text, out) for (ids, text), (_, out) in zip(prompts, lengths, strict=True)]


async def stream_one(session: Any, ep: Endpoint, r: Request) -> Stream:
    body = {"model": ep.model, "prompt": r.text if ep.text_prompt else r.prompt,
            "max_tokens": r.max_tokens, "temperature": 0.0, "stream": True,
            **ep.extra(r.max_tokens)}  # fmt: skip
    times: list[float] = []
    pieces: list[str] = []
    tokens = 0
    start = time.perf_counter()
    async with session.post(f"{ep.base}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{ep.name} answered {resp.status}: {(await resp.text())[:500]}")
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter()
            event = json.loads(data)
            if isinstance(event.get("usage"), dict):
                tokens = event["usage"]["completion_tokens"]
            texts = [c["text"] for c in event.get("choices") or [] if c.get("text")]
            if texts:
                times.append(now)
                pieces += texts
    if not times:
        raise RuntimeError(f"{ep.name} streamed no text for a {len(r.prompt)}-token prompt")
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return Stream(times[0] - start, gaps, len(times), tokens or len(times), "".join(pieces))


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process `pid` has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fused_steps(ep: Endpoint) -> dict[str, float]:
    """The hub's fused steps so far by the threads each ran on (`hub_llm_fused_steps`
    on /metrics); empty for a peer."""
    if ep.name != "hub":
        return {}
    import httpx

    text = httpx.get(f"{ep.base}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("hub_llm_fused_steps_total{"):
            labels, value = line.rsplit(" ", 1)
            threads = labels.split('threads="', 1)[1].split('"', 1)[0]
            out[threads] = out.get(threads, 0.0) + float(value)
    return out


async def run_phase(ep: Endpoint, requests: list[Request], concurrency: int) -> dict[str, Any]:
    """`requests` streamed from `ep` at `concurrency`; also what the server's process spent
    (`server_cpu_s`) and, for the hub, its fused steps by thread count (`fused_steps`)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=1800, sock_read=300)
    # A connection per request: llama-server may close a kept-alive one after a stream ends.
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    streams: dict[int, Stream] = {}
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        todo = iter(enumerate(requests))

        async def worker() -> None:
            for i, r in todo:  # the workers share one iterator
                streams[i] = await stream_one(session, ep, r)

        load = os.getloadavg()[0]
        with _server_cost(ep) as cost:
            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            seconds = time.perf_counter() - start
    summary = summarize([streams[i] for i in range(len(requests))], requests, seconds, load)
    return {**summary, **cost}


async def run_interleaved(eps: list[Endpoint], requests: list[Request]) -> dict[str, Any]:
    """`requests` one at a time on every server in turn (request i on each, the servers'
    order rotated each request), all servers up at once: a change of the machine's speed
    during the phase falls on every server alike. Per server, as `run_phase` at 1."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=1800, sock_read=300)
    streams: dict[str, list[Stream]] = {ep.name: [] for ep in eps}
    seconds = dict.fromkeys(streams, 0.0)
    costs: dict[str, list[dict[str, Any]]] = {ep.name: [] for ep in eps}
    load = os.getloadavg()[0]
    async with contextlib.AsyncExitStack() as stack:
        sessions = {
            ep.name: await stack.enter_async_context(
                aiohttp.ClientSession(
                    timeout=timeout, connector=aiohttp.TCPConnector(limit=1, force_close=True)
                )
            )
            for ep in eps
        }
        for i, r in enumerate(requests):
            for ep in eps[i % len(eps) :] + eps[: i % len(eps)]:
                with _server_cost(ep) as cost:
                    start = time.perf_counter()
                    streams[ep.name].append(await stream_one(sessions[ep.name], ep, r))
                    seconds[ep.name] += time.perf_counter() - start
                costs[ep.name].append(cost)
    out: dict[str, Any] = {}
    for ep in eps:
        summary = summarize(streams[ep.name], requests, seconds[ep.name], load)
        total: dict[str, Any] = {"server_cpu_s": round(
            sum(c["server_cpu_s"] for c in costs[ep.name]), 3
        )}  # fmt: skip
        steps: dict[str, float] = {}
        for c in costs[ep.name]:
            for k, v in c.get("fused_steps", {}).items():
                steps[k] = steps.get(k, 0.0) + v
        if steps:
            total["fused_steps"] = steps
        out[ep.name] = {**summary, **total, "interleaved": True}
    return out


@contextlib.contextmanager
def _server_cost(ep: Endpoint) -> Iterator[dict[str, Any]]:
    """Fills the yielded dict, once the block ends, with the CPU seconds `ep`'s process
    used meanwhile and (the hub) its fused steps by thread count."""
    cost: dict[str, Any] = {}
    steps_before = fused_steps(ep)
    cpu_before = process_cpu_s(ep.pid)
    yield cost
    cost["server_cpu_s"] = round(process_cpu_s(ep.pid) - cpu_before, 3)
    steps = {k: v - steps_before.get(k, 0.0) for k, v in fused_steps(ep).items()}
    if steps:
        cost["fused_steps"] = steps


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summarize(
    streams: list[Stream], requests: list[Request], seconds: float, load: float
) -> dict[str, Any]:
    tokens = sum(s.output_tokens for s in streams)
    ttfts = [s.ttft for s in streams]
    gaps = [g for s in streams for g in s.gaps]
    return {
        "requests": len(streams),
        "output_tokens": tokens,
        "output_tokens_asked": sum(r.max_tokens for r in requests),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "ttft_p50_ms": 1000 * _pct(ttfts, 0.5),
        "ttft_p99_ms": 1000 * _pct(ttfts, 0.99),
        "itl_p50_ms": 1000 * _pct(gaps, 0.5),
        "itl_p99_ms": 1000 * _pct(gaps, 0.99),
        # Below 1: some events carried several tokens (their gaps are then per event).
        "events_per_token": sum(s.events for s in streams) / max(tokens, 1),
        "load_average_1m": load,
        # Dropped before the JSON is written, once compared across servers.
        "texts": [s.text for s in streams],
    }


def servers(args: argparse.Namespace, model_dir: Path, root: Path) -> dict[str, Callable[[], Any]]:
    """Each server to measure, as a factory of its context manager; a missing peer is
    skipped with a message saying how to get it."""
    out: dict[str, Callable[[], Any]] = {
        "hub": lambda: peer_servers.hub_server(model_dir, root / "hub", args.threads)
    }
    if "llama.cpp" not in args.skip:
        try:
            binary = peer_servers.find_llama_server(args.llama_server, CACHE)
            gguf = peer_servers.ensure_gguf(model_dir, args.converter, CACHE)
            out["llama.cpp"] = lambda: peer_servers.llama_server(binary, gguf, root, args.threads)
            args.llama_version = peer_servers.llama_version(binary)
        except PeerMissing as e:
            tqdm.write(f"llama.cpp skipped: {e}")
    if "transformers" not in args.skip:
        out["transformers"] = lambda: peer_servers.transformers_server(
            model_dir, root, args.threads
        )
    return out


@contextlib.contextmanager
def warmed(factory: Callable[[], Any], warm: Request) -> Iterator[Endpoint]:
    """The server started and one short request answered (lazy initialization, e.g.
    transformers' batching manager, happens on the first request)."""
    with factory() as ep:
        asyncio.run(run_phase(ep, [warm], 1))
        yield ep


def aggregate(rounds: list[dict[str, dict[str, Any]]], names: list[str]) -> dict[str, Any]:
    """Medians over rounds per server and concurrency, and the hub's per-round ratios."""
    keys = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
    summary: dict[str, Any] = {}
    for name in names:
        for conc in rounds[0][name]:
            runs = [r[name][conc] for r in rounds if conc in r.get(name, {})]
            summary.setdefault(name, {})[conc] = {
                k: statistics.median(run[k] for run in runs) for k in keys
            }
    ratios: dict[str, Any] = {}
    for peer in names:
        if peer == "hub":
            continue
        for conc in rounds[0]["hub"]:
            per_round = [r["hub"][conc]["tokens_per_s"] / r[peer][conc]["tokens_per_s"]
                         for r in rounds]  # fmt: skip
            hub, other = summary["hub"][conc], summary[peer][conc]
            ratios.setdefault(f"hub_over_{peer}", {})[conc] = {
                "tokens_per_s": statistics.median(per_round),
                "tokens_per_s_rounds": per_round,
                "ttft_p50": hub["ttft_p50_ms"] / other["ttft_p50_ms"],
                "itl_p50": hub["itl_p50_ms"] / other["itl_p50_ms"],
            }
    return {"medians": summary, "ratios": ratios, "same_text_as_hub": same_text(rounds, names)}


def same_text(rounds: list[dict[str, dict[str, Any]]], names: list[str]) -> dict[str, str]:
    """How many greedy answers each peer streamed with exactly the hub's text, over every
    request of every round (the same weights, so all but numeric near-ties should match);
    the texts are then dropped from the measurements."""
    out: dict[str, list[int]] = {peer: [0, 0] for peer in names if peer != "hub"}
    for measured in rounds:
        for conc, hub in measured["hub"].items():
            for peer in out:
                pairs = zip(hub["texts"], measured[peer][conc]["texts"], strict=True)
                out[peer][0] += sum(a == b for a, b in pairs)
                out[peer][1] += len(hub["texts"])
        for phases in measured.values():
            for phase in phases.values():
                phase.pop("texts", None)
    return {peer: f"{same}/{total}" for peer, (same, total) in out.items()}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    medians = results["summary"]["medians"]
    names = list(medians)
    concs = list(medians["hub"])
    colors = {"hub": "#1f77b4", "llama.cpp": "#ff7f0e", "transformers": "#999999"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (("tokens_per_s", "output tokens / s"), ("ttft_p50_ms", "TTFT p50 (ms)"),
              ("itl_p50_ms", "inter-token latency p50 (ms)"))  # fmt: skip
    width = 0.8 / len(names)
    for ax, (key, label) in zip(axes, panels, strict=True):
        for i, name in enumerate(names):
            xs = [c + (i - (len(names) - 1) / 2) * width for c in range(len(concs))]
            bars = ax.bar(xs, [medians[name][c][key] for c in concs], width, label=name,
                          color=colors.get(name))  # fmt: skip
            ax.bar_label(bars, fmt="%.0f" if key == "tokens_per_s" else "%.1f", fontsize=7)
        ax.set_xticks(range(len(concs)), [f"concurrency {c}" for c in concs])
        ax.set_ylabel(label)
        if key != "tokens_per_s":
            ax.set_yscale("log")
    axes[0].legend()
    fig.suptitle(f"{results['model']}, {results['rounds']} interleaved rounds (medians), "
                 f"{results['threads']} threads each; load average "
                 f"{results['load_average']['start'][0]:.1f}-"
                 f"{results['load_average']['end'][0]:.1f} on {os.cpu_count()} cores")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _report(rnd: int, name: str, conc: int, phase: dict[str, Any]) -> None:
    tqdm.write(f"round {rnd + 1} {name} c={conc}: "
               f"{phase['tokens_per_s']:.0f} tok/s, TTFT p50 {phase['ttft_p50_ms']:.0f} ms, "
               f"ITL p50 {phase['itl_p50_ms']:.1f} ms, server CPU {phase['server_cpu_s']:.1f} s"
               + (f", steps by threads {phase['fused_steps']}" if "fused_steps" in phase else "")
               + (" (interleaved)" if phase.get("interleaved") else ""))  # fmt: skip


def run_rounds(
    args: argparse.Namespace, tokenizer: Any, factories: dict[str, Callable[[], Any]]
) -> tuple[list[dict[str, dict[str, Any]]], list[Request]]:
    """Every server at every concurrency, once a round; each round's measurements and the
    last round's workload. Concurrency 1 runs interleaved (every server up, request by
    request in turn, `run_interleaved`) unless `--sequential`; the other concurrencies one
    server running at a time (the order rotated each round)."""
    names = list(factories)
    rounds: list[dict[str, dict[str, Any]]] = []
    interleave = 1 in args.concurrency and not args.sequential
    apart = [c for c in args.concurrency if not (interleave and c == 1)]
    steps = args.rounds * (len(names) * len(apart) + interleave)
    with tqdm(total=steps, desc="phases") as bar:
        for rnd in range(args.rounds):
            work = workload(tokenizer, args.requests, args.seed, rnd, args.quick)
            warm = Request(work[0].prompt[:8], str(tokenizer.decode(work[0].prompt[:8])), 4)
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            measured: dict[str, dict[str, Any]] = {n: {} for n in names}
            if interleave:
                bar.set_postfix_str(f"round {rnd + 1}: all at 1")
                with contextlib.ExitStack() as stack:
                    eps = [stack.enter_context(warmed(factories[n], warm)) for n in order]
                    phases = asyncio.run(run_interleaved(eps, work[: args.c1_requests]))
                for name in order:
                    measured[name]["1"] = phases[name]
                    _report(rnd, name, 1, phases[name])
                bar.update()
            for name in order if apart else []:
                with warmed(factories[name], warm) as ep:
                    for conc in apart:
                        requests = work[: args.c1_requests] if conc == 1 else work
                        bar.set_postfix_str(f"round {rnd + 1}: {name} at {conc}")
                        phase = asyncio.run(run_phase(ep, requests, conc))
                        measured[name][str(conc)] = phase
                        _report(rnd, name, conc, phase)
                        bar.update()
            rounds.append(measured)
    return rounds, work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small workload, one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--c1-requests", type=int, default=8,
                        help="requests of the concurrency-1 phase (the first N)")  # fmt: skip
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--sequential", action="store_true",
        help="concurrency 1 too one server at a time (default: request by request in turn)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="threads of each server")
    parser.add_argument("--model-dir", type=Path, default=CACHE / "model",
                        help="the benchmark model (built there if missing)")  # fmt: skip
    parser.add_argument(
        "--llama-server",
        type=Path,
        help=f"llama.cpp's server binary (default: {CACHE}/llama-server)",
    )
    parser.add_argument(
        "--converter",
        type=Path,
        help="llama.cpp's convert_hf_to_gguf.py (default: "
        f"{CACHE}/convert_hf_to_gguf.py), needed once for the GGUF file",
    )
    parser.add_argument("--skip", nargs="*", default=[], choices=["llama.cpp", "transformers"])
    parser.add_argument("--out", type=Path, default=RESULTS / "llm_peers.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.llama_version = None
    if args.quick:
        args.rounds, args.requests, args.c1_requests = 1, 8, 2
        if args.out == RESULTS / "llm_peers.json":
            args.out = RESULTS / "llm_peers-quick.json"

    from transformers import AutoTokenizer

    from backends.tiny import build_benchmark_llm

    if not (args.model_dir / "config.json").is_file():
        build_benchmark_llm(args.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    with tempfile.TemporaryDirectory(prefix="llm-peers-") as tmp:
        (Path(tmp) / "hub").mkdir()
        rounds_load = os.getloadavg()
        rounds, work = run_rounds(args, tokenizer, servers(args, args.model_dir, Path(tmp)))
    names = list(rounds[0])

    import transformers

    results: dict[str, Any] = {
        "model": "Llama 26M fp32 (GGUF F32 for llama.cpp)",
        "threads": args.threads,
        "rounds": args.rounds,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "load_average": {"start": rounds_load, "end": os.getloadavg()},
        "versions": {"llama.cpp": args.llama_version, "transformers": transformers.__version__},
        "workload": {
            "requests": args.requests,
            "c1_requests": args.c1_requests,
            "concurrency": args.concurrency,
            "seed": args.seed,
            "prompt_tokens": [len(r.prompt) for r in work],
            "output_tokens": [r.max_tokens for r in work],
        },
        "summary": aggregate(rounds, names),
        "rounds_raw": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(json.dumps(results["summary"], indent=2))


if __name__ == "__main__":
    main()
