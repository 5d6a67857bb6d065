"""The engine's host time per decode step: scheduling, buffer filling, sampling bookkeeping
and output handling, with a model so small that its forward is a minor part.

On a GPU the host's share of a step runs in series with the device unless steps launch ahead
(`async_steps`), and then only while it is shorter than the device's share: this measures it
where it can be changed, on the CPU, through the static decode step (the code a GPU replays,
run eagerly here), synchronous and launched ahead, side by side in one process.

    python benchmarks/engine_host.py                    # 64 rows, 3 rounds of 200 steps
    python benchmarks/engine_host.py --rows 8 --steps 500

Prints, per mode, the minimum over rounds of the mean milliseconds per step (a host-bound
figure: compare modes and trees side by side, not across machines).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=64, help="sequences decoding at once")
    p.add_argument("--steps", type=int, default=200, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per mode, interleaved")
    args = p.parse_args(argv)

    import torch

    from backends.llm.config import EngineConfig
    from backends.llm.engine import LLMEngine
    from backends.llm.model_runner import ModelRunner
    from backends.llm.sampling_params import SamplingParams
    from backends.tiny.llm import build_tiny_llm

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_llm(
            Path(tmp) / "llm", "llama", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1
        )
        times: dict[str, list[float]] = {"sync": [], "async": []}
        for _ in range(args.rounds):
            for mode in times:
                config = EngineConfig(
                    kv_cache_bytes=64 * 2**20,
                    max_num_seqs=max(args.rows, 1),
                    max_num_batched_tokens=max(512, args.rows),
                    max_model_len=args.steps + 64,
                    fused_step=False,
                    async_steps=mode == "async",
                )
                runner = ModelRunner.load(folder, "cpu", torch.float32, config, static_decode=True)
                engine = LLMEngine(config, runner)
                new = args.steps + 20
                params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
                for i in range(args.rows):
                    engine.add_request(str(i), [5 + i % 50, 9, 14, 30], params)
                for _ in range(5):  # the prefill and a few decodes
                    engine.step()
                start = time.perf_counter()
                for _ in range(args.steps):
                    engine.step()
                times[mode].append((time.perf_counter() - start) / args.steps * 1e3)
    result = {
        "rows": args.rows,
        "steps": args.steps,
        "ms_per_step": {mode: round(min(t), 3) for mode, t in times.items()},
        "rounds_ms": {mode: [round(x, 3) for x in t] for mode, t in times.items()},
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
