"""The grouped expert matmul (`backends.llm.moe`, "ours") against transformers' experts
module (Mixtral's; Qwen2/3-MoE's is the same code) on the CPU, at batch 1 and 32 tokens (a
decode step of one and of 32 sequences) and a 256-token prefill chunk. transformers runs the
module as its config's `experts_implementation` says: "eager" is the per-expert Python loop,
"grouped_mm" (the default a model loads with here, torch >= 2.9 having a CPU kernel) one
`grouped_mm` call per projection, "batched_mm" a padded bmm over every (token, expert) pair.

One Mixtral experts module of `--hidden` x `--intermediate` with `--experts` experts, top-2
routing of random tokens; each size times every forward in turn, `--iters` calls each per
round, over `--rounds` rounds, and reports the median time per call and the ratio of each
one's time to ours per round (median). The outputs are checked equal first. Results:
benchmarks/results/moe_experts.json and .png.

    python benchmarks/moe_experts.py [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as a script from anywhere
    sys.path.insert(0, str(REPO))

from backends.llm.moe import grouped_experts_forward  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
SIZES = (1, 32, 256)
TRANSFORMERS = ("eager", "grouped_mm", "batched_mm")


def timed(fn: Any, args: tuple[Any, ...], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    return (time.perf_counter() - start) / iters


@torch.inference_mode()
def main() -> None:
    from tqdm import tqdm
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=RESULTS / "moe_experts.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = MixtralConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
    )
    stock = MixtralExperts(config)
    torch.nn.init.normal_(stock.gate_up_proj, std=args.hidden**-0.5)
    torch.nn.init.normal_(stock.down_proj, std=args.intermediate**-0.5)
    ours = types.MethodType(grouped_experts_forward, stock)

    module_config: Any = stock.config

    def implementation(name: str) -> Any:
        def call(*args: Any) -> Any:
            module_config._experts_implementation = name
            return stock(*args)

        return call

    forwards = {name: implementation(name) for name in TRANSFORMERS} | {"ours": ours}
    result: dict[str, Any] = {
        "shape": vars(args) | {"out": None},
        "threads": torch.get_num_threads(),
    }
    with tqdm(total=len(SIZES) * args.rounds, desc="moe experts", unit="round") as bar:
        for tokens in SIZES:
            hidden = torch.randn(tokens, args.hidden)
            logits = torch.randn(tokens, args.experts)
            weights, index = torch.topk(logits.softmax(-1), 2, dim=-1)
            call = (hidden, index, weights)
            reference = forwards["eager"](*call)
            for forward in forwards.values():
                assert torch.allclose(forward(*call), reference, atol=1e-5)
            times: dict[str, list[float]] = {name: [] for name in forwards}
            for _ in range(args.rounds):
                for name, forward in forwards.items():
                    times[name].append(timed(forward, call, args.iters))
                bar.update()
            result[f"tokens_{tokens}"] = {
                name: {
                    "ms_median": 1e3 * statistics.median(values),
                    "vs_ours_median_of_rounds": statistics.median(
                        v / o for v, o in zip(values, times["ours"], strict=True)
                    ),
                }
                for name, values in times.items()
            }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k.startswith("tokens")}, indent=2))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [*TRANSFORMERS, "ours"]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [result[f"tokens_{t}"][name]["ms_median"] for t in SIZES]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(SIZES))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(SIZES)), [str(t) for t in SIZES])
    ax.set_xlabel("tokens in the call")
    ax.set_ylabel("ms per call (median)")
    ax.set_yscale("log")
    ax.set_title("Mixtral experts module on the CPU: transformers' implementations vs ours")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
