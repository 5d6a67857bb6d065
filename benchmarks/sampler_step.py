"""The sampler's time per step, alone: random logits over a 32k vocabulary at batch 1, 8
and 64, for each kind of request the sampler treats differently.

Each case builds `--batch` sequences (a 512-token prompt and 128 output tokens already
generated, as in a long decode), then times `--steps` sampler calls, appending each sampled
token to its sequence as the engine does (so penalty state grows as it would). Reports the
median milliseconds per step of wall time (with `--device cuda` including the host copies and
the wait), or with `--cpu-time` of the process's CPU time (steadier on a shared machine).
Prints a table; `--out FILE` also writes the JSON.

    python benchmarks/sampler_step.py [--batch 1 8 64] [--steps 30] [--vocab 32000]
        [--device cpu] [--threads N] [--cpu-time] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from backends.llm.sampler import Sampler  # noqa: E402
from backends.llm.sampling_params import SamplingParams  # noqa: E402
from backends.llm.sequence import Sequence  # noqa: E402

CASES: dict[str, dict[str, object]] = {
    "greedy": {"temperature": 0.0},
    "top_k_top_p": {"temperature": 0.8, "top_k": 50, "top_p": 0.95},
    "seeded": {"temperature": 0.8, "top_p": 0.9, "seed": 1234},
    "penalties": {
        "temperature": 0.8,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.3,
    },
    "logprobs_5": {"temperature": 0.8, "logprobs": 5},
    "logit_bias": {"temperature": 0.0, "logit_bias": {i * 7: 1.5 for i in range(20)}},
}


def sequences(case: str, batch: int, vocab: int) -> list[Sequence]:
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(batch):
        prompt = torch.randint(2, vocab, (512,), generator=gen).tolist()
        s = Sequence(i, f"r{i}", prompt, SamplingParams(**CASES[case]), max_tokens=10**6,
                     block_size=16, index=i)  # fmt: skip
        for t in torch.randint(2, vocab, (128,), generator=gen).tolist():
            s.append_token(t)
        seqs.append(s)
    return seqs


def time_case(case: str, batch: int, args: argparse.Namespace) -> float:
    device = torch.device(args.device)
    seqs = sequences(case, batch, args.vocab)
    sampler = Sampler([1])
    gen = torch.Generator().manual_seed(1)
    times = []
    for step in range(args.warmup + args.steps):
        logits = torch.randn(batch, args.vocab, generator=gen).mul_(3).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start, cpu = time.perf_counter(), time.process_time()
        sampler.prepare(seqs)
        out = sampler(logits, seqs)
        elapsed = time.process_time() - cpu if args.cpu_time else time.perf_counter() - start
        for s, t in zip(seqs, out.token_ids, strict=True):
            s.append_token(t)
        if step >= args.warmup:
            times.append(elapsed * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    parser.add_argument(
        "--cpu-time", action="store_true", help="the process's CPU time, not wall time"
    )
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for case in args.cases:
            results[case] = {str(b): time_case(case, b, args) for b in args.batch}
    clock = "CPU" if args.cpu_time else "wall"
    print(f"{clock} ms per step (median of {args.steps}), vocab {args.vocab}, "
          f"device {args.device}, {torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'case':<14}" + "".join(f"{'batch ' + str(b):>11}" for b in args.batch))
    for case, row in results.items():
        print(f"{case:<14}" + "".join(f"{row[str(b)]:>11.2f}" for b in args.batch))
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                        "ms_per_step": results}, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
