"""One stream, quiet and contended: the hub's engine in process against llama.cpp's
`llama-server`, on the same target and the same threads, per-token gaps side by side.

The model is the target of the trained benchmark pair (`backends/tiny/trained.py`, built and
cached on first use; llama.cpp reads its F32 GGUF next to it, made by `llm_peers.py` or
`speculative.py`), or `--model-dir` with its `--gguf` (`llm_peers.py`'s 26M Llama: its
cache folder's `model` and `model-f32.gguf`). Each request is a fresh 100-token prompt and
256 greedy tokens (`ignore_eos`). The hub runs in this process, one request at a time
through `LLMEngine.step`; a token's gap is the time between two steps that emitted.
llama.cpp streams from `/completion`; a token's gap is the time between two streamed events.

Two conditions, in one run: quiet, then contended (`--busy` processes spinning on the CPU,
started here and killed afterwards). Under each, per request, in turn: the hub at `--threads`
threads with the thread count fixed, at one thread, at `--threads` with its adaptive count
(the default: `backends/llm/fused/threads.py`), llama.cpp at `--threads`, and the hub over
HTTP (`hub serve` on the same model in a process of its own, streamed `/v1/completions`
read as llama.cpp's stream is; `--no-http` leaves it out): the in-process and HTTP arms side
by side split what the engine costs from what serving it costs. Reported per
system and condition: per-token gaps at p50, p90, p99 and max, the mean (what tokens/s is),
and the 1-minute load average before and after. Results go to
`benchmarks/results/one_stream.json`.

    python benchmarks/one_stream.py [--threads 2] [--busy 1] [--requests 6] [--tokens 256]
        [--model-dir DIR --gguf FILE] [--no-http]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python benchmarks/<name>.py` from anywhere
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from backends.llm.config import EngineConfig  # noqa: E402
from backends.llm.engine import LLMEngine  # noqa: E402
from backends.llm.model_runner import ModelRunner  # noqa: E402
from backends.llm.sampling_params import SamplingParams  # noqa: E402
from backends.tiny.trained import BENCHMARK_PAIR, build_trained_pair  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
LLAMA_SERVER = Path.home() / ".cache" / "model-hub" / "llm-peers" / "llama-server"
PROMPT_TOKENS = 100


def summary(gaps: list[float]) -> dict[str, float]:
    """Per-token gaps (seconds) as milliseconds: p50, p90, p99, max, mean, and how many."""
    s = sorted(gaps)

    def pct(q: float) -> float:
        return 1e3 * s[min(len(s) - 1, int(q * len(s)))]

    return {
        "p50_ms": pct(0.5),
        "p90_ms": pct(0.9),
        "p99_ms": pct(0.99),
        "max_ms": 1e3 * s[-1],
        "mean_ms": 1e3 * statistics.fmean(s),
        "over_20ms": sum(g > 0.02 for g in s),
        "tokens": len(s) + 1,
    }


class Hub:
    """The engine on the benchmark target, one request at a time."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        config = EngineConfig(
            kv_cache_bytes=256 * 2**20, max_num_seqs=64, max_num_batched_tokens=512
        )
        self.runner = ModelRunner.load(model_dir, "cpu", torch.float32, config)
        self.engine = LLMEngine(config, self.runner, AutoTokenizer.from_pretrained(model_dir))
        self._ids = 0

    def gaps(self, prompt: list[int], tokens: int, threads: int, adaptive: bool) -> list[float]:
        torch.set_num_threads(threads)
        self.runner.fused.adaptive = adaptive
        self._ids += 1
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        self.engine.add_request(f"r{self._ids}", prompt, params)
        stamps = []
        while self.engine.has_work():
            if self.engine.step():
                stamps.append(time.perf_counter())
        return [b - a for a, b in itertools.pairwise(stamps)]


@contextlib.contextmanager
def llama_server(gguf: Path, threads: int, port: int) -> Iterator[Callable[..., list[float]]]:
    argv = [str(LLAMA_SERVER), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
            "-c", "2048", "-np", "1", "--port", str(port), "--no-warmup"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)

        def gaps(prompt: list[int], tokens: int) -> list[float]:
            body = {"prompt": prompt, "n_predict": tokens, "ignore_eos": True,
                    "temperature": 0, "cache_prompt": False, "stream": True}  # fmt: skip
            request = urllib.request.Request(
                f"{url}/completion", json.dumps(body).encode(), {"content-type": "application/json"}
            )
            stamps = []
            with urllib.request.urlopen(request, timeout=300) as response:
                for line in response:
                    if line.startswith(b"data: ") and b'"content"' in line:
                        event = json.loads(line[6:])
                        if not event.get("stop"):
                            stamps.append(time.perf_counter())
            return [b - a for a, b in itertools.pairwise(stamps)]

        yield gaps
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def hub_over_http(model_dir: Path, threads: int) -> Iterator[Callable[..., list[float]]]:
    """`hub serve` on the same model in a process of its own (`peer_servers.hub_server`),
    streamed as llama.cpp is: a token's gap is the time between two streamed events."""
    import tempfile

    from benchmarks import peer_servers

    with (
        tempfile.TemporaryDirectory(prefix="one-stream-hub-") as root,
        peer_servers.hub_server(model_dir, Path(root), threads) as ep,
    ):

        def gaps(prompt: list[int], tokens: int) -> list[float]:
            body = {"model": ep.model, "prompt": prompt, "max_tokens": tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
            request = urllib.request.Request(
                f"{ep.base}/v1/completions",
                json.dumps(body).encode(),
                {"content-type": "application/json"},
            )
            stamps = []
            with urllib.request.urlopen(request, timeout=300) as response:
                for line in response:
                    if line.startswith(b"data: {") and b'"text"' in line:
                        stamps.append(time.perf_counter())
            return [b - a for a, b in itertools.pairwise(stamps)]

        yield gaps


@contextlib.contextmanager
def busy(count: int) -> Iterator[None]:
    """`count` processes spinning on the CPU while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(1.0)  # let the load average see them
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--busy", type=int, default=1, help="spinning processes when contended")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--port", type=int, default=18555)
    parser.add_argument(
        "--model-dir", type=Path,
        help="another model (default: the trained pair's target), with --gguf",
    )  # fmt: skip
    parser.add_argument("--gguf", type=Path, help="llama.cpp's F32 GGUF of --model-dir")
    parser.add_argument(
        "--no-http", action="store_true", help="leave out the hub over HTTP (`hub serve`)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "one_stream.json")
    args = parser.parse_args()
    if args.model_dir is not None:
        if args.gguf is None:
            parser.error("--model-dir needs --gguf")
        model_dir, gguf = args.model_dir, args.gguf
    else:
        pair = build_trained_pair(BENCHMARK_PAIR)
        model_dir, gguf = pair.target, pair.target.parent / "target-f32.gguf"
    hub = Hub(model_dir)
    rng = random.Random(0)
    n = args.threads
    systems: dict[str, Callable[[list[int]], list[float]]] = {
        f"hub {n} threads fixed": lambda p: hub.gaps(p, args.tokens, n, adaptive=False),
        "hub 1 thread": lambda p: hub.gaps(p, args.tokens, 1, adaptive=False),
        f"hub {n} threads adaptive": lambda p: hub.gaps(p, args.tokens, n, adaptive=True),
    }
    conditions: dict[str, Any] = {}
    with contextlib.ExitStack() as servers:
        llama = servers.enter_context(llama_server(gguf, n, args.port))
        systems[f"llama.cpp {n} threads"] = lambda p: llama(p, args.tokens)
        if not args.no_http:
            http = servers.enter_context(hub_over_http(model_dir, n))
            systems[f"hub over HTTP {n} threads"] = lambda p: http(p, args.tokens)
        warm = [rng.randrange(3, 2048) for _ in range(PROMPT_TOKENS)]
        for run in systems.values():
            run(warm)
        for name, count in (("quiet", 0), ("contended", args.busy)):
            with busy(count):
                hub.runner.fused.thread_choice.steps.clear()
                load_before = os.getloadavg()[0]
                gaps: dict[str, list[float]] = {system: [] for system in systems}
                for _ in range(args.requests):
                    prompt = [rng.randrange(3, 2048) for _ in range(PROMPT_TOKENS)]
                    for system, run in systems.items():
                        gaps[system] += run(prompt)
                load_after = os.getloadavg()[0]
            steps = hub.runner.fused.thread_choice.steps
            conditions[name] = {
                "adaptive_steps_by_threads": dict(sorted(steps.items())),
                "busy_processes": count,
                "load_1m": [round(load_before, 2), round(load_after, 2)],
                "systems": {system: summary(g) for system, g in gaps.items()},
            }
            print(f"{name} (busy {count}, load {load_before:.1f} -> {load_after:.1f}), "
                  f"adaptive steps by threads {dict(sorted(steps.items()))}")  # fmt: skip
            for system, s in conditions[name]["systems"].items():
                print(f"  {system:26s} p50 {s['p50_ms']:6.2f}  p90 {s['p90_ms']:6.2f}  "
                      f"p99 {s['p99_ms']:6.2f}  max {s['max_ms']:7.1f}  "
                      f"mean {s['mean_ms']:6.2f} ms  >20ms {s['over_20ms']}")  # fmt: skip
    result = {
        "benchmark": "one_stream",
        "model": str(model_dir),
        "threads": n,
        "requests": args.requests,
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": args.tokens,
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "conditions": conditions,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
