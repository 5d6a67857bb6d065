"""Peak memory of loading a quantized LLM: quantizing tensor by tensor while the checkpoint
is read (the hub's path) against loading the float32 model whole and quantizing it after
(the path before), with a plain float32 load for scale.

Each load runs in a fresh subprocess, which reports its peak resident set (`VmHWM` from
/proc/self/status, kept by the kernel) and the peak of its anonymous memory (`RssAnon`,
sampled every millisecond by a thread): the safetensors file is memory-mapped, and its pages
count in the resident set while mapped but belong to the page cache (reclaimable, shared),
so the anonymous peak is what a load really holds. The checkpoint is saved in bfloat16 by
default (as published checkpoints are): loading it as float32 casts every tensor into new
memory, which the path before held all at once. Figures are medians over `--runs`
interleaved rounds, minus the same figures of a process that only imported torch and
transformers (the baseline every load pays). Results: benchmarks/results/quantized_load.json
and .png.

    python benchmarks/quantized_load.py [--params 60000000] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as a script from anywhere
    sys.path.insert(0, str(REPO))

RESULTS = REPO / "benchmarks" / "results"
MODES = ("baseline", "float32", "int8_after_load", "int8_while_loading")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child(mode: str, folder: Path) -> dict[str, Any]:
    """Load the model of `folder` the `mode` way in this process; its peaks in MiB."""
    import torch
    import transformers  # noqa: F401 - imported by the baseline too

    from backends.llm.quantization import WeightQuantizer
    from backends.loading import load_causal_lm, module_bytes

    peak_anon = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak_anon[0] = max(peak_anon[0], _status_kib("RssAnon"))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    weights = 0
    if mode != "baseline":
        transform = WeightQuantizer() if mode == "int8_while_loading" else None
        model = load_causal_lm(folder, "cpu", torch.float32, transform=transform)
        if mode == "int8_after_load":
            WeightQuantizer().apply(model)
        weights = module_bytes(model)
    done.set()
    sampler.join()
    return {
        "peak_rss_mib": _status_kib("VmHWM") / 1024,
        "peak_anon_mib": peak_anon[0] / 1024,
        "weights_mib": weights / 2**20,
    }


def main() -> None:
    from tqdm import tqdm

    from backends.tiny import build_benchmark_llm

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=60_000_000, help="model size")
    parser.add_argument("--runs", type=int, default=3, help="interleaved rounds")
    parser.add_argument(
        "--checkpoint-dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="dtype the weights are saved in (loaded as float32 either way)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "quantized_load.json")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_benchmark_llm(Path(tmp) / "model", target_params=args.params)
        if args.checkpoint_dtype == "bfloat16":
            _to_bfloat16(folder)
        samples: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        with tqdm(total=args.runs * len(MODES), desc="loads", unit="load") as bar:
            for _ in range(args.runs):
                for mode in MODES:
                    out = subprocess.run(
                        [sys.executable, __file__, "--child", mode, str(folder)],
                        check=True,
                        capture_output=True,
                        text=True,
                        timeout=600,
                    ).stdout
                    samples[mode].append(json.loads(out.strip().splitlines()[-1]))
                    bar.update()
    base = {k: statistics.median(s[k] for s in samples["baseline"]) for k in samples["baseline"][0]}
    result: dict[str, Any] = {
        "params": args.params,
        "checkpoint_dtype": args.checkpoint_dtype,
        "runs": args.runs,
        "baseline": base,
    }
    for mode in MODES[1:]:
        result[mode] = {
            k: statistics.median(s[k] for s in samples[mode])
            - (base[k] if k != "weights_mib" else 0)
            for k in samples[mode][0]
        }
    after, streaming = result["int8_after_load"], result["int8_while_loading"]
    result["peak_anon_ratio_while_vs_after"] = streaming["peak_anon_mib"] / after["peak_anon_mib"]
    result["peak_rss_ratio_while_vs_after"] = streaming["peak_rss_mib"] / after["peak_rss_mib"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result, indent=2))


def _to_bfloat16(folder: Path) -> None:
    """Resave the checkpoint in bfloat16, as most published checkpoints are: a float32 load
    then casts every tensor into new memory (a float32 checkpoint is used in place, mapped)."""
    import torch
    from safetensors.torch import load_file, save_file

    for path in folder.glob("*.safetensors"):
        tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES[1:] if m in result]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.27
    for i, key in enumerate(("weights_mib", "peak_anon_mib", "peak_rss_mib")):
        xs = [j + (i - 1) * width for j in range(len(modes))]
        ax.bar(xs, [result[m][key] for m in modes], width, label=key.removesuffix("_mib"))
    ax.set_xticks(range(len(modes)), modes)
    ax.set_ylabel("MiB above an idle process")
    ax.set_title(
        f"Loading a {result['params'] / 1e6:.0f}M-parameter Llama "
        f"({result['checkpoint_dtype']} checkpoint) as float32: peak memory"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
