"""Where one speculative round's time goes at one stream, in process (no HTTP), against one
plain decode step of the same target.

The trained pair (`backends/tiny/trained.py`) decodes code prompts greedily one request at
a time, once without speculation and once with each proposer. Wall-clock wrappers time the
parts of each engine step: the proposer (the draft model's catch-up and single-token steps,
or prompt lookup), the scheduler's `schedule` and `update` (rollback included), the target's
`execute` (the verify step) and the rest of the engine step (output, detokenizing). Prints a
JSON breakdown in milliseconds per engine step with tokens per step, which path (fused
or packed) the target's and the draft's steps took, and a target step's median time by the
tokens it ran (a verify step of k drafts runs k + 1 beside a plain decode's one); `--out`
also writes it.

    python benchmarks/speculative_profile.py [--requests 4] [--max-tokens 128] [--threads 2]
        [--num-tokens 4] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from backends.llm.config import EngineConfig  # noqa: E402
from backends.llm.engine import LLMEngine  # noqa: E402
from backends.llm.model_runner import ModelRunner  # noqa: E402
from backends.llm.sampling_params import SamplingParams  # noqa: E402
from backends.llm.speculative.draft_model import DraftModel  # noqa: E402
from backends.runtime_config import SpeculativeConfig  # noqa: E402

ENGINE = {"kv_cache_bytes": 256 * 2**20, "max_num_seqs": 64, "max_num_batched_tokens": 512}


class Timers:
    """Wall time and calls per named part."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += time.perf_counter() - start
                self.calls[name] += 1

        setattr(obj, attr, wrapper)


def steps_by_tokens(runner: Any) -> dict[int, list[float]]:
    """Wrap the runner's `execute` to record each step's seconds by its scheduled tokens."""
    seen: dict[int, list[float]] = defaultdict(list)
    fn = runner.execute

    def execute(output: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(output)
        finally:
            tokens = sum(item.num_tokens for item in output.scheduled)
            seen[tokens].append(time.perf_counter() - start)

    runner.execute = execute
    return seen


def build_engine(pair: Any, spec: SpeculativeConfig | None, tokenizer: Any) -> LLMEngine:
    config = EngineConfig(speculative=spec, **ENGINE)
    runner = ModelRunner.load(pair.target, "cpu", torch.float32, config)
    proposer = None
    if spec is not None and spec.kind == "draft":
        draft_config = EngineConfig(**ENGINE, enable_prefix_caching=False)
        draft_runner = ModelRunner.load(pair.draft, "cpu", torch.float32, draft_config)
        proposer = DraftModel(
            draft_runner,
            config.block_size,
            config.max_num_batched_tokens,
            spec.min_draft_probability,
        )
    return LLMEngine(config, runner, tokenizer, proposer=proposer)


def profile(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Run the prompts one at a time (after one warm-up request) with the parts timed."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def run(prompt: list[int], rid: str) -> list[int]:
        engine.add_request(rid, prompt, params)
        tokens: list[int] = []
        while engine.has_work():
            for out in engine.step():
                tokens += out.token_ids
        return tokens

    run(prompts[0], "warm")
    t = Timers()
    t.wrap(engine, "step", "engine_step")
    t.wrap(engine.scheduler, "schedule", "schedule")
    t.wrap(engine.scheduler, "update", "update")
    t.wrap(engine.runner, "execute", "target_execute")
    by_tokens = steps_by_tokens(engine.runner)
    draft_runner = None
    if engine.speculator is not None:
        t.wrap(engine.speculator, "propose", "propose")
        proposer = engine.speculator.proposer
        if isinstance(proposer, DraftModel):
            draft_runner = proposer.runner
            t.wrap(proposer, "_catch_up", "draft_catch_up")
            t.wrap(proposer, "_decode", "draft_decode")
            t.wrap(draft_runner, "execute", "draft_execute")
    target_fused, draft_fused = (
        engine.runner.fused.steps,
        (draft_runner.fused.steps if draft_runner else 0),
    )
    outputs = []
    cpu, start = time.process_time(), time.perf_counter()
    for i, prompt in enumerate(prompts):
        outputs.append(run(prompt, f"r{i}"))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o) for o in outputs)
    steps = t.calls["engine_step"]
    per_step = {k: round(1e3 * v / steps, 4) for k, v in sorted(t.total.items())}
    out: dict[str, Any] = {
        "tokens": tokens,
        "engine_steps": steps,
        "tokens_per_engine_step": round(tokens / steps, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "ms_per_token": round(1e3 * wall / tokens, 4),
        "cpu_ms_per_token": round(1e3 * cpu / tokens, 4),
        "ms_per_engine_step": per_step,
        "calls_per_engine_step": {k: round(v / steps, 3) for k, v in sorted(t.calls.items())},
        "target_steps_fused": engine.runner.fused.steps - target_fused,
        # A target step's median time by the tokens it ran (one: a plain decode; more: a
        # verify step; past 9, prefill chunks): what a verify step costs beside a decode.
        "target_step_ms_by_tokens": {
            n: {"steps": len(ts), "median_ms": round(1e3 * statistics.median(ts), 4)}
            for n, ts in sorted(by_tokens.items())
            if n <= 9
        },
        "outputs": outputs,
    }
    if draft_runner is not None:
        out["draft_steps_fused"] = draft_runner.fused.steps - draft_fused
        calls = t.calls["draft_execute"]
        out["ms_per_draft_step"] = round(1e3 * t.total["draft_execute"] / max(calls, 1), 4)
    if engine.speculator is not None:
        out["speculation"] = engine.metrics.speculation.summary()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-tokens", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="the quick pair")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from backends.tiny.stdlib_corpus import stdlib_corpus
    from backends.tiny.trained import BENCHMARK_PAIR, QUICK_PAIR, build_trained_pair
    from benchmarks.speculative import code_chunks

    spec = QUICK_PAIR if args.quick else BENCHMARK_PAIR
    pair = build_trained_pair(spec)
    tokenizer = AutoTokenizer.from_pretrained(pair.target)
    held_out = stdlib_corpus(spec.train_chars, spec.held_out_chars).held_out
    rng = random.Random(0)
    chunks = code_chunks(held_out, rng, args.requests + 1)
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    plain_prompts = [encode(c)[:96] for c in chunks]
    copy_prompts = []
    for chunk in chunks:
        text = tokenizer.decode(encode(chunk)[:160])
        copy_prompts.append(encode(f"{text}\n\n{text.splitlines(keepends=True)[0]}"))
    k = args.num_tokens
    arms: dict[str, tuple[SpeculativeConfig | None, list[list[int]]]] = {
        "target": (None, plain_prompts),
        "target-draft": (SpeculativeConfig(draft="draft@1", num_tokens=k), plain_prompts),
        "target-copy": (None, copy_prompts),
        "target-ngram-copy": (
            SpeculativeConfig(method="ngram", num_tokens=k, min_match=1, max_match=3),
            copy_prompts,
        ),
    }
    results: dict[str, Any] = {"pair": spec.name, "threads": args.threads, "num_tokens": k}
    results["load_average_start"] = os.getloadavg()
    for name, (config, prompts) in arms.items():
        engine = build_engine(pair, config, tokenizer)
        results[name] = profile(engine, prompts, args.max_tokens)
    results["load_average_end"] = os.getloadavg()
    for name in ("target-draft", "target-ngram-copy"):
        base = "target" if name == "target-draft" else "target-copy"
        same = results[name].pop("outputs") == results[base]["outputs"]
        results[name]["same_tokens_as_plain"] = same
        results[name]["speedup"] = round(
            results[name]["tokens_per_s"] / results[base]["tokens_per_s"], 3
        )
    for name in ("target", "target-copy"):
        results[name].pop("outputs")
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
