"""Tenancy: what sharing one model between teams costs the interactive one.

Priorities section: an interactive request's time to first token (TTFT) while batch-class
requests saturate the same LLM, against its TTFT on an idle engine, with priority classes
on (batch requests at the batch level, interactive ones at the interactive level) and off
(every request at one level, as before classes existed), side by side in one process.

The engine runs in this process on the ~25M-parameter benchmark Llama (random weights,
float32, CPU; `--quick`: the tiny test Llama), stepping synchronously as the engine thread
does. `--batch-requests` (32) batch requests (prompts of 64-128 tokens, `--batch-tokens`
(64) generated each, EOS ignored) are kept outstanding, each one that finishes replaced, on
an engine of `--max-num-seqs` (16) seats; once every seat decodes, an interactive request (a
64-token prompt) arrives every
`--every` steps, `--interactive` (6) of them. Per interactive request, its TTFT in steps and
in milliseconds; medians over requests, and the ratio loaded / idle of each (the idle figure:
the same prompts one at a time on the idle engine). Rounds alternate on and off; medians over
`--rounds` (2). Results: `benchmarks/results/tenancy.json` (`priorities`).

Admission section: what a key's rate limits cost a request at the ingress. One in-process
hub with auth on (SQLite, the limits' sync running every 0.5 s) answers `--admission-requests`
(2000) requests of each of two keys, alternately: one with every limit (requests and tokens
per minute, tokens per day, max_concurrent: none ever reached), one with none. The model
named is not registered, so each answer is a 404 right after admission: the request is
little besides the ingress, and the limits' share of it shows. Per key, the p50 and p90 of
a request's latency in the client; the difference of the p50s is the overhead
(`admission`). A section left out by `--sections` keeps its previous result in the file.

    python benchmarks/tenancy.py [--quick] [--rounds N] [--interactive N]
    python benchmarks/tenancy.py --sections admission
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
from pathlib import Path
from typing import Any

import httpx
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from backends.llm.config import EngineConfig  # noqa: E402
from backends.llm.engine import LLMEngine  # noqa: E402
from backends.llm.model_runner import ModelRunner  # noqa: E402
from backends.llm.sampling_params import SamplingParams  # noqa: E402
from backends.priority import PriorityClass  # noqa: E402
from backends.tiny import build_benchmark_llm, build_tiny_llm  # noqa: E402
from hub.app import create_app  # noqa: E402
from hub.settings import HubSettings  # noqa: E402
from registry.db import Database, upgrade  # noqa: E402
from registry.keys import ApiKeys, KeyLimits  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"
# Token ids below this are the tokenizer's special tokens; prompts avoid them.
FIRST_PLAIN_TOKEN = 7


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prompts(count: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(rng.randint(*lengths))]
        for _ in range(count)
    ]


class BatchLoad:
    """`len(prompts)` batch requests kept outstanding: each one that finishes is replaced by
    the next prompt (cycling), so the engine stays saturated however long the run."""

    def __init__(
        self, engine: LLMEngine, prompts: list[list[int]], tokens: int, level: int
    ) -> None:
        self.engine, self.prompts, self.tokens, self.level = engine, prompts, tokens, level
        self.sent = 0
        self.outstanding: set[str] = set()
        for _ in prompts:
            self._send()

    def _send(self) -> None:
        request_id = f"batch-{self.sent}"
        prompt = self.prompts[self.sent % len(self.prompts)]
        self.engine.add_request(request_id, prompt, greedy(self.tokens), priority=self.level)
        self.outstanding.add(request_id)
        self.sent += 1

    def step(self) -> list[str]:
        """One engine step; the ids of the other requests that got a token."""
        others = []
        for out in self.engine.step():
            if out.request_id in self.outstanding:
                if out.finished:
                    self.outstanding.discard(out.request_id)
                    self._send()
            else:
                others.append(out.request_id)
        return others

    def stop(self) -> None:
        for request_id in self.outstanding:
            self.engine.abort_request(request_id)
        while self.engine.has_work():
            self.engine.step()


def first_token(step: Any, request_id: str) -> tuple[int, float]:
    """Call `step` until `request_id` has its first token: (steps, seconds)."""
    start, steps = time.perf_counter(), 0
    while True:
        steps += 1
        if request_id in step():
            return steps, time.perf_counter() - start


def idle_ttft(engine: LLMEngine, chats: list[list[int]], tag: str) -> list[tuple[int, float]]:
    def step() -> list[str]:
        return [out.request_id for out in engine.step()]

    figures = []
    for i, prompt in enumerate(chats):
        engine.add_request(f"{tag}-{i}", prompt, greedy(1))
        figures.append(first_token(step, f"{tag}-{i}"))
        while engine.has_work():
            engine.step()
    return figures


def loaded_ttft(
    engine: LLMEngine,
    batch: list[list[int]],
    chats: list[list[int]],
    args: argparse.Namespace,
    *,
    classes: bool,
) -> list[tuple[int, float]]:
    """Interactive TTFTs while `batch` saturates the engine; each interactive request is
    stepped to its first token, then the batch work goes on alone for `--every` steps."""
    batch_level = PriorityClass.BATCH.level if classes else 0
    chat_level = PriorityClass.INTERACTIVE.level if classes else 0
    load = BatchLoad(engine, batch, args.batch_tokens, batch_level)
    scheduler = engine.scheduler
    while len(scheduler.running) < args.max_num_seqs or any(
        s.num_output_tokens == 0 for s in scheduler.running
    ):
        load.step()
    figures = []
    for i, prompt in enumerate(chats):
        engine.add_request(f"chat-{i}", prompt, greedy(1), priority=chat_level)
        figures.append(first_token(load.step, f"chat-{i}"))
        for _ in range(args.every):
            load.step()
    load.stop()
    return figures


def summary(figures: list[tuple[int, float]]) -> dict[str, float]:
    return {
        "ttft_steps_p50": statistics.median(s for s, _ in figures),
        "ttft_steps_max": max(s for s, _ in figures),
        "ttft_ms_p50": statistics.median(t for _, t in figures) * 1000,
        "ttft_ms_max": max(t for _, t in figures) * 1000,
    }


def priorities(engine: LLMEngine, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    chats = prompts(args.interactive, (64, 64), vocab, seed=1)
    batch = prompts(args.batch_requests, (64, 128), vocab, seed=2)
    rounds: list[dict[str, Any]] = []
    idle_ttft(engine, chats, "warmup")
    for r in range(args.rounds):
        engine.kv_cache.reset_prefix_cache()
        idle = summary(idle_ttft(engine, chats, f"idle{r}"))
        row: dict[str, Any] = {"idle": idle}
        for classes in (True, False) if r % 2 == 0 else (False, True):
            engine.kv_cache.reset_prefix_cache()
            loaded = summary(loaded_ttft(engine, batch, chats, args, classes=classes))
            loaded["ratio_steps_p50"] = loaded["ttft_steps_p50"] / idle["ttft_steps_p50"]
            loaded["ratio_ms_p50"] = loaded["ttft_ms_p50"] / idle["ttft_ms_p50"]
            row["classes_on" if classes else "classes_off"] = loaded
        rounds.append(row)
        print(json.dumps({"round": r, **row}), flush=True)

    def median(section: str, key: str) -> float:
        return statistics.median(row[section][key] for row in rounds)

    keys = ("ttft_steps_p50", "ttft_ms_p50", "ratio_steps_p50", "ratio_ms_p50")
    return {
        "idle": {k: median("idle", k) for k in keys[:2]},
        "classes_on": {k: median("classes_on", k) for k in keys},
        "classes_off": {k: median("classes_off", k) for k in keys},
        "rounds": rounds,
    }


async def admission_latencies(root: Path, requests: int) -> dict[str, list[float]]:
    """Seconds per request of a key with every limit and of one with none, alternately."""
    settings = HubSettings(
        database_url=f"sqlite:///{root / 'hub.db'}",
        mlflow_tracking_uri=f"sqlite:///{root / 'mlflow.db'}",
        cache_dir=root / "cache",
        devices=[{"name": "cpu", "memory_budget": "1GiB"}],
        auth={"enabled": True, "bootstrap_admin_key": "bench-admin"},
    )
    upgrade(settings.database_url)
    keys = ApiKeys(Database(settings.database_url))
    big = 10**9
    limited, _ = keys.create("limited", "user", limits=KeyLimits(big, big, big, 10**6))
    unlimited, _ = keys.create("unlimited", "user")
    body = {"model": "absent", "input": ["a short text to embed"]}
    times: dict[str, list[float]] = {"limits_on": [], "limits_off": []}
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://hub") as client:
            pairs = (("limits_on", limited), ("limits_off", unlimited))
            for i in range(requests + 100):  # the first 100 of each warm up
                for label, key in pairs if i % 2 == 0 else pairs[::-1]:
                    headers = {"Authorization": f"Bearer {key}"}
                    start = time.perf_counter()
                    r = await client.post("/v1/embeddings", json=body, headers=headers)
                    elapsed = time.perf_counter() - start
                    assert r.status_code == 404, r.text
                    assert ("x-ratelimit-limit-requests" in r.headers) == (label == "limits_on")
                    if i >= 100:
                        times[label].append(elapsed)
    return times


def admission(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        times = asyncio.run(admission_latencies(Path(tmp), args.admission_requests))

    def ms(values: list[float], q: int) -> float:
        return statistics.quantiles(values, n=100)[q - 1] * 1000

    out: dict[str, Any] = {
        label: {"p50_ms": ms(values, 50), "p90_ms": ms(values, 90), "requests": len(values)}
        for label, values in times.items()
    }
    out["overhead_p50_ms"] = out["limits_on"]["p50_ms"] - out["limits_off"]["p50_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, one round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-requests", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--interactive", type=int, default=6)
    parser.add_argument("--every", type=int, default=8, help="steps between interactive ones")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--admission-requests", type=int, default=2000)
    parser.add_argument("--sections", default="priorities,admission",
                        help="comma-separated: priorities, admission")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS / "tenancy.json")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if args.quick:
        args.rounds, args.batch_tokens, args.admission_requests = 1, 32, 300
    previous = json.loads(args.out.read_text()) if args.out.is_file() else {}
    result: dict[str, Any] = {**previous, "benchmark": "tenancy", "machine": {
        "platform": platform.platform(), "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads()}}  # fmt: skip
    if "priorities" in sections:
        result.update(run_priorities(args))
    if "admission" in sections:
        before, started = os.getloadavg(), time.time()
        result["admission"] = {
            **admission(args),
            "load_average_before": before,
            "load_average_after": os.getloadavg(),
            "seconds": time.time() - started,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if "priorities" in sections:
        p = result["priorities"]
        on, off = p["classes_on"], p["classes_off"]
        print(
            f"interactive TTFT p50: idle {p['idle']['ttft_ms_p50']:.1f} ms; under "
            f"{args.batch_requests} batch requests, classes on {on['ratio_ms_p50']:.2f}x idle "
            f"({on['ratio_steps_p50']:.2f}x in steps), off {off['ratio_ms_p50']:.2f}x "
            f"({off['ratio_steps_p50']:.2f}x)"
        )
    if "admission" in sections:
        a = result["admission"]
        print(
            f"admission p50: limits on {a['limits_on']['p50_ms']:.3f} ms, off "
            f"{a['limits_off']['p50_ms']:.3f} ms: overhead {a['overhead_p50_ms']:.3f} ms"
        )


def run_priorities(args: argparse.Namespace) -> dict[str, Any]:
    """The priorities section and the fields of the file that describe its run."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or Path(tmp) / "model"
        if not (model_dir / "config.json").is_file():
            if args.quick:
                build_tiny_llm(model_dir, "llama")
            else:
                build_benchmark_llm(model_dir)
        config = EngineConfig(kv_cache_bytes=256 * 2**20, max_num_seqs=args.max_num_seqs)
        runner = ModelRunner.load(model_dir, "cpu", torch.float32, config)
        engine = LLMEngine(config, runner)
        vocab = runner.vocab_size
        started = time.time()
        settings = {k: v for k, v in vars(args).items()
                    if k not in ("out", "model_dir", "sections", "admission_requests")}  # fmt: skip
        return {
            "model": "tiny llama" if args.quick else "benchmark llama (~25M, float32)",
            "load_average_before": os.getloadavg(),
            "settings": settings,
            "priorities": priorities(engine, vocab, args),
            "load_average_after": os.getloadavg(),
            "seconds": time.time() - started,
        }


if __name__ == "__main__":
    main()
