"""Overload: a burst of concurrent mixed requests against one hub, shed or absorbed.

Two scenarios (`--scenario`), each a real `hub serve` process measured from this one by an
asyncio HTTP client:

- `demo` (the default): the models of configs/demo.yaml (all-MiniLM-L6-v2 embeddings and the
  tiny Llama's chat completions), a burst of chat + embeddings requests half and half. First
  with the demo's settings (the hub's `max_queue_time_ms`: every model admits a request by
  the work estimated ahead of it on its device, backends/admission.py and
  backends/llm/engine_work.py), then with that bound off (only the edge's
  `max_requests_in_progress`, the previous behaviour). For each: WARM_UP requests one at a
  time (not measured), the unloaded latency (`--probes` mixed requests one at a time: p50,
  p90, p99, and how many took over 3x the p50, so that a stall shows as one), then the
  burst; with the bound, the same burst naming models that do not exist (404s: the floor).
- `encoders`: all-MiniLM-L6-v2 and a small cross-encoder (rerank, built on the spot), first
  with shedding on (`max_queue_time_ms` on both models and `--max-in-progress` at the HTTP
  edge), unloaded and burst; the same burst naming models that do not exist (404s: the
  floor HTTP, JSON and the event loop set); then a second process with every bound off.

The client is a bare HTTP/1.1 one (benchmarks/raw_http.py) by default: on two shared cores
httpx's own CPU per request dominates what a burst measures (`--client httpx` to see it).

It reports, for each burst, how many were admitted (200) and shed (503), whether every shed
answer carried `Retry-After`, how many got no answer at all (a connection error), and the
p50/p99 latency of the admitted requests, against the unloaded p99, and the goodput: the
admitted requests answered within 3x the unloaded p99 per second of the burst
(`goodput_rps`, against the unloaded run's requests per second one at a time in
`goodput_over_unloaded_rate`). A request's latency runs
from the moment its bytes were written to the socket to its last byte back: 512 coroutines of
one client opening their connections on the same two cores take some 80 ms before the first
request is even written, time a fleet of real clients does not spend. The same percentiles
from the moment the client began each request are reported too (`p50_from_start_ms`,
`p99_from_start_ms`). The goal: admitted p99 at most 3x the unloaded p99, every shed request
a 503 with Retry-After, none lost. Results go to `benchmarks/results/overload_demo.json` and
`.png` (`overload.json` and `.png` for `encoders`).

The hubs run their compute threads on one torch thread each by default (`--compute-threads`,
OMP_NUM_THREADS; 0: the hub's own count): on two cores shared with other work, a step of the
tiny Llama on a team of two OpenMP threads waits at each barrier for a thread the kernel
descheduled, and single chat completions then took 0.5-2.5 s instead of 20-50 ms, which is
the machine's load, not the hub's admission.

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
from benchmarks.overload_client import (  # noqa: E402
    Request,
    against,
    goal_s,
    run,
    shed_counters,
)
from benchmarks.overload_plot import plot  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
EMBEDDER, RERANKER = "emb", "rr"
DOCUMENTS = 8  # per rerank request
CHAT_MAX_TOKENS = 16  # per chat completion of the demo scenario
WARM_UP = 40  # mixed requests sent one at a time, unmeasured, before the unloaded run


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
def hub_server(
    config: Path, root: Path, warm: list[Request], env: dict[str, str] | None = None
) -> Iterator[str]:
    """`hub serve --config CONFIG` in `root` (`env` added to its environment), answering
    each of `warm` with 200 before it is handed over (each model loaded and run once);
    yields its base URL."""
    import httpx

    with hub_process(config, cwd=root, env=env, timeout=300) as (base, _proc):
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


def _demo_mix(n: int, seed: int, suffix: str = "") -> list[Request]:
    """`n` requests, chat completions and embeddings alternating, of sentences of mixed
    length; each chat asks for CHAT_MAX_TOKENS tokens; `suffix` follows the model names."""
    llm, embedder = (name + suffix for name in _demo_models())
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
        with hub_server(config, root / "shedding", warm, _env(args)) as base:
            bar.update()
            asyncio.run(run(base, _encoders_mix(WARM_UP, "", 3), args.client, at_once=False))
            runs["unloaded"] = asyncio.run(
                run(base, _encoders_mix(probes, "", seed=1), args.client, at_once=False)
            )
            bar.update()
            runs["shedding"] = asyncio.run(
                run(base, _encoders_mix(burst, "", seed=2), args.client, at_once=True,
                    within_s=goal_s(runs["unloaded"]))
            )  # fmt: skip
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
        with hub_server(config, root / "absorbing", warm, _env(args)) as base:
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
    report.update(against(runs["unloaded"], runs["shedding"]))
    return report


def _demo_phases(args: argparse.Namespace, burst: int, probes: int) -> dict[str, Any]:
    """Every measured run of the demo scenario: the demo's bound, then that bound off. Each
    hub is warmed up (WARM_UP requests one at a time) before its unloaded run."""
    from tqdm import tqdm

    llm, embedder = _demo_models()
    bound = _demo_settings().get("max_queue_time_ms")
    if args.max_queue_time_ms is not None:
        bound = args.max_queue_time_ms
    warm = _demo_mix(8, seed=0)
    report: dict[str, Any] = {"scenario": "demo", "models": [llm, embedder],
                              "chat_max_tokens": CHAT_MAX_TOKENS, "warm_up": WARM_UP,
                              "compute_threads": args.compute_threads,
                              "max_queue_time_ms": bound}  # fmt: skip
    with (
        tempfile.TemporaryDirectory(prefix="overload-bench-") as tmp,
        tqdm(total=4, desc="overload", unit="phase") as bar,
    ):
        _freeze_heap()
        for name, limit in (("admission", bound), ("previous", None)):
            root = Path(tmp) / name
            root.mkdir()
            with hub_server(_demo_config(root, limit), root, warm, _env(args)) as base:
                bar.update()
                asyncio.run(run(base, _demo_mix(WARM_UP, seed=3), args.client, at_once=False))
                unloaded = asyncio.run(
                    run(base, _demo_mix(probes, seed=1), args.client, at_once=False)
                )
                loaded = asyncio.run(
                    run(base, _demo_mix(burst, seed=2), args.client, at_once=True,
                        within_s=goal_s(unloaded))
                )  # fmt: skip
                loaded["shed_metrics"] = shed_counters(base)
                if limit is not None:
                    # The same burst naming models nobody serves: every answer a 404 from
                    # the route, no model involved: what HTTP and the event loop cost.
                    report["http_floor"] = asyncio.run(
                        run(base, _demo_mix(burst, 2, "-missing"), args.client, at_once=True)
                    )
                bar.update()
            report[name] = {
                "max_queue_time_ms": limit,
                "unloaded": unloaded,
                "burst": loaded,
                **against(unloaded, loaded),
            }
    return report


def _env(args: argparse.Namespace) -> dict[str, str] | None:
    """The hubs' environment: OMP_NUM_THREADS where `--compute-threads` asks for a count."""
    if not args.compute_threads:
        return None
    return {"OMP_NUM_THREADS": str(args.compute_threads)}


def _freeze_heap() -> None:
    # This process holds torch and transformers (it built models, or imports them): a full
    # garbage collection of its heap mid-burst would stall the client, not the hub.
    gc.collect()
    gc.freeze()


# ---- the report ---------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=("demo", "encoders"), default="demo")
    parser.add_argument("--quick", action="store_true", help="a burst of 128, fewer probes")
    parser.add_argument("--burst", type=int, help="concurrent requests in the burst")
    parser.add_argument("--probes", type=int, help="unloaded requests (default 200)")
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
    parser.add_argument(
        "--compute-threads", type=int, default=1,
        help="OMP_NUM_THREADS of the hubs: the torch threads of each compute thread (0: the "
        "hub's own default, torch's count within the CPUs)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    burst = args.burst or (128 if args.quick else 512)
    probes = args.probes or (40 if args.quick else 200)

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
