"""Where a decode step's time goes: GEMM, attention, the rest of the forward, sampling,
scheduling, input preparation, detokenizing and output handling, and what is left (Python).

The benchmark Llama (~25M parameters, float32, or int8 with `--quantization int8`) decodes
`--batch` sequences at once; after a warm-up, each part is timed over `--steps` decode steps
with wall-clock wrappers around `nn.Linear` / `Int8Linear` forwards (GEMM), the paged
attention function (attention), the sampler, the model's forward, the scheduler's
`schedule` and `update` (with the block manager), the runner's input preparation, the
engine's per-sequence output (detokenizer included) and the engine's step; the process's CPU
time per step is reported beside the wall time (on a shared machine the steadier figure).
Prints a JSON breakdown (milliseconds per step and fractions); `--out` also writes it.

    python benchmarks/llm_step_profile.py [--batch 64] [--steps 20] [--quantization int8]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from backends.llm import attention, model_runner  # noqa: E402
from backends.llm.config import EngineConfig  # noqa: E402
from backends.llm.engine import LLMEngine  # noqa: E402
from backends.llm.fused.kernel import FusedKernel  # noqa: E402
from backends.llm.model_runner import ModelRunner  # noqa: E402
from backends.llm.quantization import Int8Linear  # noqa: E402
from backends.llm.sampling_params import SamplingParams  # noqa: E402
from backends.tiny import build_benchmark_llm  # noqa: E402

totals: dict[str, float] = defaultdict(float)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument(
        "--transformers",
        action="store_true",
        help="steps through the transformers modules (fused_step off)",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="llm-profile-")) / "model"
    if not (model_dir / "config.json").is_file():
        build_benchmark_llm(model_dir)
    config = EngineConfig(
        kv_cache_bytes=256 * 2**20,
        max_num_seqs=max(64, args.batch),
        fused_step=not args.transformers,
    )
    runner = ModelRunner.load(
        model_dir, "cpu", torch.float32, config, quantization=args.quantization
    )
    from transformers import AutoTokenizer

    # With the tokenizer, as served: each step's tokens are detokenized.
    engine = LLMEngine(config, runner, AutoTokenizer.from_pretrained(model_dir))
    params = SamplingParams(temperature=0.0, max_tokens=1024, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), [7 + (i * 13 + j) % 8000 for j in range(128)], params)
    scheduler = engine.scheduler
    # Requests reach the scheduler in the next step: wait for all of them to be running.
    while len(scheduler.running) < args.batch or any(
        s.num_computed_tokens < 128 for s in scheduler.running
    ):
        engine.step()  # prefill
    for _ in range(3):
        engine.step()  # warm-up decodes

    # Each layer's own forward: the native few-row kernel replaces it per instance.
    for module in runner.model.modules():
        if isinstance(module, torch.nn.Linear | Int8Linear):
            module.forward = timed("gemm", module.forward)  # type: ignore[method-assign]
    from transformers import AttentionInterface

    AttentionInterface.register(
        attention.ATTENTION_NAME, timed("attention", attention.paged_attention)
    )
    sampler_class = type(runner.sampler)
    sampler_class.__call__ = timed("sampling", sampler_class.__call__)  # type: ignore[method-assign]
    runner.model = timed("forward", runner.model)
    FusedKernel.step = timed("fused", FusedKernel.step)  # type: ignore[method-assign]
    runner._prepare = timed("inputs", runner._prepare)  # type: ignore[method-assign]
    model_runner.fused_rows = timed("inputs", model_runner.fused_rows)
    scheduler.schedule = timed("schedule", scheduler.schedule)  # type: ignore[method-assign]
    scheduler.update = timed("update", scheduler.update)  # type: ignore[method-assign]
    engine.requests.emit = timed("outputs", engine.requests.emit)  # type: ignore[method-assign]
    step = timed("step", engine.step)
    cpu = time.process_time()
    for _ in range(args.steps):
        step()
    cpu_per_step = 1000 * (time.process_time() - cpu) / args.steps
    per_step = defaultdict(float, {k: 1000 * v / args.steps for k, v in totals.items()})
    forward_other = per_step["forward"] - per_step["gemm"] - per_step["attention"]
    named = ("forward", "fused", "sampling", "inputs", "schedule", "update", "outputs")
    python = per_step["step"] - sum(per_step[k] for k in named)
    parts = {
        "fused step (the whole forward in one native call)": per_step["fused"],
        "gemm": per_step["gemm"],
        "attention": per_step["attention"],
        "forward_other (norms, rotary, activations, module calls)": forward_other,
        "sampling": per_step["sampling"],
        "inputs (runner: tensors, tables; the fused step's rows)": per_step["inputs"],
        "schedule (scheduler + block manager)": per_step["schedule"],
        "update (scheduler: append, stop checks)": per_step["update"],
        "outputs (detokenizer, RequestOutput, latencies)": per_step["outputs"],
        "engine_other (step loop, metrics)": python,
    }
    result = {
        "batch": args.batch,
        "quantization": args.quantization or "none",
        "threads": args.threads,
        "ms_per_step": per_step["step"],
        "cpu_ms_per_step": cpu_per_step,
        "ms": parts,
        "fraction": {k: v / per_step["step"] for k, v in parts.items()},
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
