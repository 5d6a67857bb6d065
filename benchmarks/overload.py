"""Overload: a burst of concurrent mixed requests against one hub, shed or absorbed.

Two scenarios (`--scenario`), each a real `hub serve` process measured from this one by an
asyncio HTTP client:

- `demo` (the default): the models of configs/demo.yaml (all-MiniLM-L6-v2 embeddings and the
  tiny Llama's chat completions), a burst of chat + embeddings requests half and half. First
  with the demo's settings (the hub's `max_queue_time_ms`: every model admits a request by
  the work estimated ahead of it on its device, backends/admission.py and
  backends/llm/engine_work.py), then with that bound off (only the edge's
  `max_requests_in_progress`, the previous behaviour). For each: the unloaded latency
  (mixed requests one at a time), then the burst.
- `encoders`: all-MiniLM-L6-v2 and a small cross-encoder (rerank, built on the spot), first
  with shedding on (`max_queue_time_ms` on both models and `--max-in-progress` at the HTTP
  edge), unloaded and burst; the same burst naming models that do not exist (404s: the
  floor HTTP, JSON and the event loop set); then a second process with every bound off.

The client is a bare HTTP/1.1 one (benchmarks/raw_http.py) by default: on two shared cores
httpx's own CPU per request dominates what a burst measures (`--client httpx` to see it).

It reports, for each burst, how many were admitted (200) and shed (503), whether every shed
answer carried `Retry-After`, how many got no answer at all (a connection error), and the
p50/p99 latency of the admitted requests, against the unloaded p99. A request's latency runs
from the moment its bytes were written to the socket to its last byte back: 512 coroutines of
one client opening their connections on the same two cores take some 80 ms before the first
request is even written, time a fleet of real clients does not spend. The same percentiles
from the moment the client began each request are reported too (`p50_from_start_ms`,
`p99_from_start_ms`). The goal: admitted p99 at most 3x the unloaded p99, every shed request
a 503 with Retry-After, none lost. Results go to `benchmarks/results/overload_demo.json` and
`.png` (`overload.json` and `.png` for `encoders`).

    python benchmarks/overload.py                          # demo, a burst of 512
    python benchmarks/overload.py --scenario encoders      # embeddings + rerank
    python benchmarks/overload.py --quick                  # a burst of 128
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
from benchmarks.overload_client import Request, run, shed_counters  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
EMBEDDER, RERANKER = "emb", "rr"
DOCUMENTS = 8  # per rerank request
CHAT_MAX_TOKENS = 16  # per chat completion of the demo scenario


@dataclass(frozen=True)
class Shedding:
    """The bounds of the hub that sheds: a model's queue time, and the HTTP edge's."""

    max_queue_time_ms: float
    max_in_progress: int
    max_event_loop_lag: float  # seconds


# ---- the hubs -----------------------------------------------------------------------------
def _encoders_config(
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


def _demo_settings() -> dict[str, Any]:
    import yaml

    settings: dict[str, Any] = yaml.safe_load(DEMO_CONFIG.read_text())
    return settings


def _demo_config(root: Path, max_queue_time_ms: float | None) -> Path:
    """configs/demo.yaml in a hub of its own under `root` (its models preloaded, its bounds
    at the demo's values), with the hub's `max_queue_time_ms` as given (None: off)."""
    demo = _demo_settings()
    models = [{**m, "preload": True} for m in demo["models"] if m.get("preload")]
    keep = {k: v for k, v in demo.items() if k.startswith("max_") or k == "manager"}
    return hub_config(root, models, **{**keep, "max_queue_time_ms": max_queue_time_ms})


@contextmanager
def hub_server(config: Path, root: Path, warm: list[Request]) -> Iterator[str]:
    """`hub serve --config CONFIG` in `root`, answering each of `warm` with 200 before it is
    handed over (each model loaded and run once); yields its base URL."""
    import httpx

    with hub_process(config, cwd=root, timeout=300) as (base, _proc):
        deadline = time.monotonic() + 300
        pending = list(warm)
        while pending:
            path, body = pending[0]
            try:
                if httpx.post(base + path, json=body, timeout=60).status_code == 200:
                    pending.pop(0)
                    continue
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                logs = "\n".join(read_log(str(p)) for p in root.glob("hub-*.log"))
                raise TimeoutError(f"hub not serving {path} {body.get('model')}:\n{logs}")
            time.sleep(0.5)
        yield base


# ---- the requests -------------------------------------------------------------------------
def _encoder_request(model: str, text: str, documents: list[str]) -> Request:
    if model.startswith(RERANKER):
        return "/v1/rerank", {"model": model, "query": text, "documents": documents}
    return "/v1/embeddings", {"model": model, "input": text}


def _encoders_mix(n: int, suffix: str, seed: int) -> list[Request]:
    """`n` requests, embeddings and rerank alternating, of sentences of mixed length."""
    rng = random.Random(seed)
    sentences = make_sentences(1024, seed)
    out = []
    for i in range(n):
        model = (EMBEDDER if i % 2 == 0 else RERANKER) + suffix
        out.append(_encoder_request(model, rng.choice(sentences), rng.sample(sentences, DOCUMENTS)))
    return out


def _demo_models() -> tuple[str, str]:
    """The demo's preloaded (LLM, embedder) names."""
    models = [m for m in _demo_settings()["models"] if m.get("preload")]
    llm = next(m["name"] for m in models if m["kind"] == "llm")
    embedder = next(m["name"] for m in models if m["kind"] == "embedder")
    return llm, embedder


def _demo_mix(n: int, seed: int) -> list[Request]:
    """`n` requests, chat completions and embeddings alternating, of sentences of mixed
    length; each chat asks for CHAT_MAX_TOKENS tokens."""
    llm, embedder = _demo_models()
    rng = random.Random(seed)
    sentences = make_sentences(1024, seed)
    out: list[Request] = []
    for i in range(n):
        text = rng.choice(sentences)
        if i % 2 == 0:
            out.append(("/v1/chat/completions", {
                "model": llm, "messages": [{"role": "user", "content": text}],
                "max_tokens": CHAT_MAX_TOKENS,
            }))  # fmt: skip
        else:
            out.append(("/v1/embeddings", {"model": embedder, "input": text}))
    return out


# ---- the runs -----------------------------------------------------------------------------
def _encoders_phases(args: argparse.Namespace, burst: int, probes: int) -> dict[str, Any]:
    """Every measured run of the encoders scenario, in order."""
    from tqdm import tqdm

    from backends.tiny import build_tiny_reranker

    runs: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="overload-bench-") as tmp,
        tqdm(total=5, desc="overload", unit="phase") as bar,
    ):
        root = Path(tmp)
        reranker = build_tiny_reranker(root / "reranker", hidden_size=256, num_layers=4)
        queue_ms = 50.0 if args.max_queue_time_ms is None else args.max_queue_time_ms
        shed = Shedding(queue_ms, args.max_in_progress, args.max_event_loop_lag)
        workers = not args.in_process
        warm = [_encoder_request(m, "warm up", ["a document"]) for m in (EMBEDDER, RERANKER)]
        _freeze_heap()
        (root / "shedding").mkdir()
        config = _encoders_config(root / "shedding", reranker, shed, workers)
        with hub_server(config, root / "shedding", warm) as base:
            bar.update()
            runs["unloaded"] = asyncio.run(
                run(base, _encoders_mix(probes, "", seed=1), args.client, at_once=False)
            )
            bar.update()
            runs["shedding"] = asyncio.run(
                run(base, _encoders_mix(burst, "", seed=2), args.client, at_once=True)
            )
            runs["shed_metrics"] = shed_counters(base)
            bar.update()
            # The same burst naming a model nobody serves: every answer a 404 from the route
            # (or the edge's 503), no model involved: what HTTP and the event loop cost.
            runs["http_floor"] = asyncio.run(
                run(base, _encoders_mix(burst, "-missing", seed=2), args.client, at_once=True)
            )
            bar.update()
        (root / "absorbing").mkdir()
        config = _encoders_config(root / "absorbing", reranker, None, workers)
        with hub_server(config, root / "absorbing", warm) as base:
            runs["absorbing"] = asyncio.run(
                run(base, _encoders_mix(burst, "", seed=2), args.client, at_once=True)
            )
            bar.update()
    report = {
        "scenario": "encoders",
        "max_queue_time_ms": queue_ms,
        "max_requests_in_progress": args.max_in_progress,
        "max_event_loop_lag": args.max_event_loop_lag,
        "encoder_worker_processes": workers,
        **runs,
    }
    report.update(_against(runs["unloaded"], runs["shedding"]))
    return report


def _demo_phases(args: argparse.Namespace, burst: int, probes: int) -> dict[str, Any]:
    """Every measured run of the demo scenario: the demo's bound, then that bound off."""
    from tqdm import tqdm

    llm, embedder = _demo_models()
    bound = _demo_settings().get("max_queue_time_ms")
    if args.max_queue_time_ms is not None:
        bound = args.max_queue_time_ms
    warm = _demo_mix(8, seed=0)
    report: dict[str, Any] = {"scenario": "demo", "models": [llm, embedder],
                              "chat_max_tokens": CHAT_MAX_TOKENS,
                              "max_queue_time_ms": bound}  # fmt: skip
    with (
        tempfile.TemporaryDirectory(prefix="overload-bench-") as tmp,
        tqdm(total=4, desc="overload", unit="phase") as bar,
    ):
        _freeze_heap()
        for name, limit in (("admission", bound), ("previous", None)):
            root = Path(tmp) / name
            root.mkdir()
            with hub_server(_demo_config(root, limit), root, warm) as base:
                bar.update()
                unloaded = asyncio.run(
                    run(base, _demo_mix(probes, seed=1), args.client, at_once=False)
                )
                loaded = asyncio.run(run(base, _demo_mix(burst, seed=2), args.client, at_once=True))
                loaded["shed_metrics"] = shed_counters(base)
                bar.update()
            report[name] = {
                "max_queue_time_ms": limit,
                "unloaded": unloaded,
                "burst": loaded,
                **_against(unloaded, loaded),
            }
    return report


def _against(unloaded: dict[str, Any], burst: dict[str, Any]) -> dict[str, Any]:
    """The burst's admitted p99 over the unloaded p99, and the goal's three checks."""
    ratio = None
    if burst["p99_ms"] and unloaded["p99_ms"]:
        ratio = round(burst["p99_ms"] / unloaded["p99_ms"], 2)
    return {
        "admitted_p99_over_unloaded_p99": ratio,
        "goal": {
            "admitted_p99_at_most_3x_unloaded": ratio is not None and ratio <= 3,
            "every_shed_a_503_with_retry_after": burst["shed"] == burst["shed_with_retry_after"],
            "none_lost": burst["lost"] == 0 and not burst["other_status"],
        },
    }


def _freeze_heap() -> None:
    # This process holds torch and transformers (it built models, or imports them): a full
    # garbage collection of its heap mid-burst would stall the client, not the hub.
    gc.collect()
    gc.freeze()


# ---- the report ---------------------------------------------------------------------------
def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if report["scenario"] == "demo":
        on, off = report["admission"], report["previous"]
        unloaded = on["unloaded"]
        bursts = [(f"burst, max_queue_time_ms={report['max_queue_time_ms']:g}", on["burst"]),
                  ("burst, bound off (previous)", off["burst"])]  # fmt: skip
        runs = [("unloaded", unloaded), *bursts]
        title = (f"A burst of {report['burst']} chat completions + embeddings on the demo "
                 f"config ({report['client']} client)")  # fmt: skip
    else:
        unloaded = report["unloaded"]
        bursts = [("burst, shedding", report["shedding"]),
                  ("burst, no shedding", report["absorbing"])]  # fmt: skip
        runs = [("unloaded", unloaded), *bursts, ("burst, all 404 (floor)", report["http_floor"])]
        title = (f"A burst of {report['burst']} mixed requests (embeddings + rerank), "
                 f"max_queue_time_ms={report['max_queue_time_ms']:g}, "
                 f"max_requests_in_progress={report['max_requests_in_progress']}, "
                 f"max_event_loop_lag={report['max_event_loop_lag']:g}s "
                 f"({report['client']} client)")  # fmt: skip
    fig, (lat, counts) = plt.subplots(1, 2, figsize=(13, 4.6))
    xs = range(len(runs))
    p50 = [r["p50_ms"] or r["answer_p50_ms"] or 0 for _, r in runs]
    p99 = [r["p99_ms"] or r["answer_p99_ms"] or 0 for _, r in runs]
    lat.bar([x - 0.2 for x in xs], p50, 0.4, label="p50")
    lat.bar([x + 0.2 for x in xs], p99, 0.4, label="p99")
    goal = 3 * (unloaded["p99_ms"] or 0)
    lat.axhline(goal, color="grey", linestyle="--", label="3x unloaded p99")
    lat.set_xticks(list(xs), [n for n, _ in runs], fontsize=8)
    lat.set_yscale("log")
    floor = "" if report["scenario"] == "demo" else "; floor: of the 404s"
    lat.set_ylabel(f"latency of admitted requests (ms){floor}")
    lat.legend()
    bx = range(len(bursts))
    counts.bar(bx, [r["admitted"] for _, r in bursts], label="admitted (200)")
    counts.bar(bx, [r["shed"] for _, r in bursts], bottom=[r["admitted"] for _, r in bursts],
               label="shed (503 + Retry-After)")  # fmt: skip
    counts.set_xticks(list(bx), [n for n, _ in bursts], fontsize=8)
    counts.set_ylabel("requests")
    counts.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=("demo", "encoders"), default="demo")
    parser.add_argument("--quick", action="store_true", help="a burst of 128, fewer probes")
    parser.add_argument("--burst", type=int, help="concurrent requests in the burst")
    parser.add_argument(
        "--max-queue-time-ms", type=float,
        help="the bound of the hub that sheds (default: demo.yaml's; encoders: 50)",
    )  # fmt: skip
    parser.add_argument(
        "--max-in-progress", type=int, default=256,
        help="encoders: max_requests_in_progress of the shedding hub (0: no edge bound)",
    )  # fmt: skip
    parser.add_argument(
        "--max-event-loop-lag", type=float, default=0.25,
        help="encoders: max_event_loop_lag (seconds) of the shedding hub (0: no lag bound)",
    )  # fmt: skip
    parser.add_argument("--client", choices=("raw", "httpx"), default="raw")
    parser.add_argument(
        "--in-process", action="store_true",
        help="encoders: encoder_worker_processes false (the passes in the hub's process)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    burst = args.burst or (128 if args.quick else 512)
    probes = 40 if args.quick else 100

    phases = _demo_phases if args.scenario == "demo" else _encoders_phases
    report = {
        "burst": burst,
        "client": args.client,
        **phases(args, burst, probes),
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "overload_demo" if args.scenario == "demo" else "overload"
    if args.client != "raw":
        name += f"-{args.client}"
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out / f"{name}.png")
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=2))
    print(f"wrote {args.out / name}.json and .png")


if __name__ == "__main__":
    main()
