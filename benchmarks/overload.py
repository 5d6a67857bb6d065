"""Overload: a burst of concurrent mixed requests against one hub, shed or absorbed.

A real `hub serve` process holds all-MiniLM-L6-v2 (embeddings) and a small cross-encoder
(rerank, built on the spot), first with shedding on: `max_queue_time_ms` on both models
(admission control, backends/admission.py) and `--max-in-progress` requests in progress at
the HTTP edge (hub/api/edge.py); then a second process with both off (queues only bounded
by `max_queue`). From this process an asyncio HTTP client

  1. measures the unloaded latency: mixed requests one at a time;
  2. sends a burst of `--burst` mixed requests at once to the hub that sheds;
  3. sends it once more naming models that do not exist (404s): the floor HTTP, JSON and
     the event loop set under the burst, whatever admission does behind them;
  4. sends the same burst to the hub that does not shed.

The client is a bare HTTP/1.1 one (benchmarks/raw_http.py) by default: on two shared cores
httpx's own CPU per request dominates what a burst measures (`--client httpx` to see it).

It reports, for each burst, how many were admitted (200) and shed (503), whether every shed
answer carried `Retry-After`, how many got no answer at all (a connection error), and the
p50/p99 latency of the admitted requests, against the unloaded p99. A request's latency runs
from the moment its bytes were written to the socket to its last byte back (the bare client
records it; httpx's is from the call): 512 coroutines of one client opening their connections
on the same two cores take some 80 ms before the first request is even written, time a fleet
of real clients does not spend. The same percentiles from the moment the client began each
request are reported too (`p50_from_start_ms`, `p99_from_start_ms`). The goal: admitted p99 at
most 3x the unloaded p99, every shed request a 503 with Retry-After, none lost. Results go to
`benchmarks/results/overload.json` and `.png`.

    python benchmarks/overload.py            # a burst of 512
    python benchmarks/overload.py --quick    # a burst of 128
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python benchmarks/<name>.py` from anywhere
    sys.path.insert(0, str(REPO))

from benchmarks.embed_throughput import make_sentences  # noqa: E402
from benchmarks.launch.process import hub_config, hub_process, read_log  # noqa: E402
from benchmarks.raw_http import post_json  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
EMBEDDER, RERANKER = "emb", "rr"


@dataclass(frozen=True)
class Shedding:
    """The bounds of the hub that sheds: a model's queue time, and the HTTP edge's."""

    max_queue_time_ms: float
    max_in_progress: int
    max_event_loop_lag: float  # seconds


DOCUMENTS = 8  # per rerank request


def _hub_config(
    root: Path, reranker: Path, shedding: Shedding | None, workers: bool = True
) -> Path:
    """`shedding` None: every bound off; `workers`: the encoders' passes in worker processes
    (the default) or in the hub's."""
    off = Shedding(max_queue_time_ms=0, max_in_progress=0, max_event_loop_lag=0)
    shedding = shedding or off
    config = {"max_queue_time_ms": shedding.max_queue_time_ms} if shedding.max_queue_time_ms else {}
    models = [
        {"name": EMBEDDER, "kind": "embedder", "source": "builtin:minilm", "preload": True,
         "config": config},
        {"name": RERANKER, "kind": "reranker", "source": str(reranker), "preload": True,
         "config": config},
    ]  # fmt: skip
    return hub_config(
        root,
        models,
        max_requests_in_progress=shedding.max_in_progress,
        max_event_loop_lag=shedding.max_event_loop_lag,
        encoder_worker_processes=workers,
    )


@contextmanager
def hub_server(
    root: Path, reranker: Path, shedding: Shedding | None, workers: bool = True
) -> Iterator[str]:
    """`hub serve` in `root` with both models loaded and answering; yields its base URL."""
    import httpx

    root.mkdir(parents=True, exist_ok=True)
    config = _hub_config(root, reranker, shedding, workers)
    with hub_process(config, cwd=root, timeout=300) as (base, _proc):
        deadline = time.monotonic() + 300
        pending = [EMBEDDER, RERANKER]
        while pending:
            path, body = _request(pending[0], "warm up", ["a document"])
            try:
                if httpx.post(base + path, json=body, timeout=60).status_code == 200:
                    pending.pop(0)
                    continue
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                logs = "\n".join(read_log(str(p)) for p in root.glob("hub-*.log"))
                raise TimeoutError(f"hub not serving {pending[0]}:\n{logs}")
            time.sleep(0.5)
        yield base


def _request(model: str, text: str, documents: list[str]) -> tuple[str, dict[str, Any]]:
    if model.startswith(RERANKER):
        return "/v1/rerank", {"model": model, "query": text, "documents": documents}
    return "/v1/embeddings", {"model": model, "input": text}


def _mix(n: int, suffix: str, seed: int) -> list[tuple[str, dict[str, Any]]]:
    """`n` requests, embeddings and rerank alternating, of sentences of mixed length."""
    rng = random.Random(seed)
    sentences = make_sentences(1024, seed)
    out = []
    for i in range(n):
        model = (EMBEDDER if i % 2 == 0 else RERANKER) + suffix
        out.append(_request(model, rng.choice(sentences), rng.sample(sentences, DOCUMENTS)))
    return out


async def _send(client: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One request, by httpx (`client` an AsyncClient) or the bare client (`client` the URL)."""
    start = time.perf_counter()
    try:
        if isinstance(client, str):
            async with asyncio.timeout(300):
                r: Any = await post_json(client, path, body)
        else:
            r = await client.post(path, json=body)
    except Exception as e:  # a request with no answer is what we count
        lost = time.perf_counter() - start
        return {"status": None, "error": type(e).__name__, "s": lost, "from_start_s": lost}
    end = time.perf_counter()
    # From the moment the request was written (the bare client knows it): the time before is
    # this client's own, its coroutines opening hundreds of connections on the same cores.
    sent = getattr(r, "sent_at", 0.0) or start
    return {
        "status": r.status_code,
        "retry_after": r.headers.get("retry-after"),
        "kind": "rerank" if "rerank" in path else "embed",
        "message": r.json().get("error", {}).get("message") if r.status_code != 200 else None,
        "s": end - sent,
        "from_start_s": end - start,
    }


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(results: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    ok = [r["s"] for r in results if r["status"] == 200]
    ok_from_start = [r["from_start_s"] for r in results if r["status"] == 200]
    shed = [r for r in results if r["status"] == 503]
    other = [r for r in results if r["status"] not in (200, 503, 404, None)]
    lost = [r for r in results if r["status"] is None]
    return {
        "sent": len(results),
        "admitted": len(ok),
        "shed": len(shed),
        "shed_with_retry_after": sum(r["retry_after"] is not None for r in shed),
        "shed_by_kind": {k: sum(r["kind"] == k for r in shed) for k in ("embed", "rerank")},
        "not_found": sum(r["status"] == 404 for r in results),
        "other_status": sorted({r["status"] for r in other}),
        "lost": len(lost),
        "lost_errors": sorted({r["error"] for r in lost}),
        # Every answer, shed and refused ones included: how fast the hub answers at all.
        "answer_p50_ms": _ms(_percentile([r["s"] for r in results if r["status"]], 0.50)),
        "answer_p99_ms": _ms(_percentile([r["s"] for r in results if r["status"]], 0.99)),
        "p50_ms": _ms(_percentile(ok, 0.50)),
        "p99_ms": _ms(_percentile(ok, 0.99)),
        "max_ms": _ms(max(ok, default=None)),
        # The same from the moment this client began the request (before connecting).
        "p50_from_start_ms": _ms(_percentile(ok_from_start, 0.50)),
        "p99_from_start_ms": _ms(_percentile(ok_from_start, 0.99)),
        "wall_s": round(wall_s, 2),
        "example_shed_message": shed[0]["message"] if shed else None,
        "_latencies": ok,
    }


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 1)


async def _run(
    base: str, requests: list[tuple[str, dict[str, Any]]], kind: str, *, at_once: bool
) -> dict[str, Any]:
    """Send `requests` one at a time or all at once, with the `kind` of client."""
    import httpx

    n = len(requests)
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as pool:
        client: Any = pool if kind == "httpx" else base
        start = time.perf_counter()
        if at_once:
            results = list(await asyncio.gather(*(_send(client, p, b) for p, b in requests)))
        else:
            results = [await _send(client, p, b) for p, b in requests]
        return _summary(results, time.perf_counter() - start)


def _shed_counters(base: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("hub_requests_shed_total{"):
            labels, value = line.rsplit(" ", 1)
            if float(value):
                out[labels.removeprefix("hub_requests_shed_total")] = float(value)
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [("unloaded", report["unloaded"]), ("burst, shedding", report["shedding"]),
            ("burst, no shedding", report["absorbing"]),
            ("burst, all 404 (floor)", report["http_floor"])]  # fmt: skip
    fig, (lat, counts) = plt.subplots(1, 2, figsize=(13, 4.6))
    names = [n for n, _ in runs]
    xs = range(len(runs))
    p50 = [r["p50_ms"] or r["answer_p50_ms"] or 0 for _, r in runs]
    p99 = [r["p99_ms"] or r["answer_p99_ms"] or 0 for _, r in runs]
    lat.bar([x - 0.2 for x in xs], p50, 0.4, label="p50")
    lat.bar([x + 0.2 for x in xs], p99, 0.4, label="p99")
    goal = 3 * (report["unloaded"]["p99_ms"] or 0)
    lat.axhline(goal, color="grey", linestyle="--", label="3x unloaded p99")
    lat.set_xticks(list(xs), names, fontsize=8)
    lat.set_yscale("log")
    lat.set_ylabel("latency of admitted requests (ms); floor: of the 404s")
    lat.legend()
    bursts = runs[1:3]
    bx = range(len(bursts))
    counts.bar(bx, [r["admitted"] for _, r in bursts], label="admitted (200)")
    counts.bar(bx, [r["shed"] for _, r in bursts], bottom=[r["admitted"] for _, r in bursts],
               label="shed (503 + Retry-After)")  # fmt: skip
    counts.set_xticks(list(bx), [n for n, _ in bursts])
    counts.set_ylabel("requests")
    counts.legend()
    fig.suptitle(
        f"A burst of {report['burst']} mixed requests (embeddings + rerank), "
        f"max_queue_time_ms={report['max_queue_time_ms']:g}, "
        f"max_requests_in_progress={report['max_requests_in_progress']}, "
        f"max_event_loop_lag={report['max_event_loop_lag']:g}s ({report['client']} client)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _phases(args: argparse.Namespace, burst: int, probes: int) -> dict[str, Any]:
    """Every measured run, in order, with a progress bar over the phases."""
    from tqdm import tqdm

    from backends.tiny import build_tiny_reranker

    runs: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="overload-bench-") as tmp,
        tqdm(total=5, desc="overload", unit="phase") as bar,
    ):
        root = Path(tmp)
        reranker = build_tiny_reranker(root / "reranker", hidden_size=256, num_layers=4)
        shed = Shedding(args.max_queue_time_ms, args.max_in_progress, args.max_event_loop_lag)
        # This process holds torch and transformers (it built the reranker): a full garbage
        # collection of its heap mid-burst would stall the client, not the hub; freeze it.
        gc.collect()
        gc.freeze()
        workers = not args.in_process
        with hub_server(root / "shedding", reranker, shed, workers) as base:
            bar.update()
            runs["unloaded"] = asyncio.run(
                _run(base, _mix(probes, "", seed=1), args.client, at_once=False)
            )
            bar.update()
            runs["shedding"] = asyncio.run(
                _run(base, _mix(burst, "", seed=2), args.client, at_once=True)
            )
            runs["shed_metrics"] = _shed_counters(base)
            bar.update()
            # The same burst naming a model nobody serves: every answer a 404 from the route
            # (or the edge's 503), no model involved: what HTTP and the event loop cost.
            runs["http_floor"] = asyncio.run(
                _run(base, _mix(burst, "-missing", seed=2), args.client, at_once=True)
            )
            bar.update()
        with hub_server(root / "absorbing", reranker, None, workers) as base:
            runs["absorbing"] = asyncio.run(
                _run(base, _mix(burst, "", seed=2), args.client, at_once=True)
            )
            bar.update()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a burst of 128, fewer probes")
    parser.add_argument("--burst", type=int, help="concurrent requests in the burst")
    parser.add_argument("--max-queue-time-ms", type=float, default=50.0)
    parser.add_argument(
        "--max-in-progress", type=int, default=256,
        help="max_requests_in_progress of the shedding hub (0: no edge bound)",
    )  # fmt: skip
    parser.add_argument(
        "--max-event-loop-lag", type=float, default=0.25,
        help="max_event_loop_lag (seconds) of the shedding hub (0: no lag bound)",
    )  # fmt: skip
    parser.add_argument("--client", choices=("raw", "httpx"), default="raw")
    parser.add_argument(
        "--in-process", action="store_true",
        help="encoder_worker_processes: false (the forward passes in the hub's process)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    burst = args.burst or (128 if args.quick else 512)
    probes = 40 if args.quick else 100

    runs = _phases(args, burst, probes)
    unloaded, shedding = runs["unloaded"], runs["shedding"]
    for name in ("unloaded", "shedding", "absorbing", "http_floor"):
        runs[name].pop("_latencies")
    ratio = None
    if shedding["p99_ms"] and unloaded["p99_ms"]:
        ratio = round(shedding["p99_ms"] / unloaded["p99_ms"], 2)
    report = {
        "burst": burst,
        "max_queue_time_ms": args.max_queue_time_ms,
        "max_requests_in_progress": args.max_in_progress,
        "max_event_loop_lag": args.max_event_loop_lag,
        "client": args.client,
        "encoder_worker_processes": not args.in_process,
        **runs,
        "admitted_p99_over_unloaded_p99": ratio,
        "goal": {
            "admitted_p99_at_most_3x_unloaded": ratio is not None and ratio <= 3,
            "every_shed_a_503_with_retry_after": shedding["shed"]
            == shedding["shed_with_retry_after"],
            "none_lost": shedding["lost"] == 0 and not shedding["other_status"],
        },
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "overload" if args.client == "raw" else f"overload-{args.client}"
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out / f"{name}.png")
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=2))
    print(f"wrote {args.out / name}.json and .png")


if __name__ == "__main__":
    main()
