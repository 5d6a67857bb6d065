"""Swap costs of the hub's model manager on a ~100M-parameter Llama: cold loads and warm
restores, each against the plainest way to do the same work.

- Cold load: the hub's load path (footprint prediction from the safetensors headers, then
  the LLM backend's `load` when that backend exists, else `backends.loading.load_causal_lm`,
  the loader it builds on; the registry lookup and thread hop around it are not timed)
  against
  `safetensors.torch.load_file` plus building the model (config read, module tree built on
  the meta device, so no memory and no initialisation). Goal: at most 1.3x. For context,
  `AutoModelForCausalLM.from_pretrained` is timed too.
- Warm restore: bringing the model back from the host tier (`backends.parking`, what
  backends offload and restore with: one host buffer, pinned on CUDA) against a plain copy
  of the same number of bytes from a host buffer of the same kind into a fresh device
  allocation. Goal: at most 1.5x. The offload that parks the weights is timed as well.

Every run interleaves the hub and its baseline (alternating which goes first), so a noisy
machine slows both; the figures are medians and ratios of medians. On the CPU, `load_file`
memory-maps the weights (from a warm page cache: the file was just written) for both paths
alike, so a cold load there is mostly building the model and the pages come in on first use;
the first forward pass after each load is timed too (`first_forward_median_s`) to show that
cost, the same for the hub and `from_pretrained`. On CUDA the loads copy every byte.
Results: benchmarks/results/swap.json and swap.png.

    python benchmarks/swap.py [--quick] [--device cuda:0] [--runs 7]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as a script from anywhere
    sys.path.insert(0, str(REPO))

from backends.base import BackendContext  # noqa: E402
from backends.kinds import backend_class  # noqa: E402
from backends.loading import (  # noqa: E402
    load_causal_lm,
    module_bytes,
    safetensors_files,
    tensor_bytes_from_headers,
)
from backends.parking import ParkedWeights, park  # noqa: E402
from backends.tiny import build_benchmark_llm  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
GOALS = {"cold_load_ratio": 1.3, "warm_restore_ratio": 1.5}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    gc.collect()
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


class HubPath:
    """The hub's load path: the LLM backend when it exists, else the loader it reuses."""

    def __init__(self, folder: Path, device: str) -> None:
        self.folder, self.device = folder, device
        try:
            self.backend_cls: Any = backend_class("llm")
            self.name = f"{self.backend_cls.__name__}.load"
        except NotImplementedError:
            self.backend_cls = None
            self.name = "backends.loading.load_causal_lm"

    def load(self) -> Any:
        """What the manager runs for a cold load: predict the footprint, then load."""
        if self.backend_cls is None:
            tensor_bytes_from_headers(safetensors_files(self.folder))
            return load_causal_lm(self.folder, self.device)
        self.backend_cls.predict_memory(self.folder, {})
        backend = self.backend_cls(BackendContext("bench", "1"))
        backend.load(self.folder, self.device)
        return backend

    @staticmethod
    def unload(loaded: Any) -> None:
        if hasattr(loaded, "unload"):
            loaded.unload()


def baseline_load(folder: Path, device: str) -> Any:
    """`load_file` plus building the model: the floor any loader stands on."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(path), device=device))
    config = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model, state


def reference_load(folder: Path, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder)).to(device)


def first_forward(model: Any, device: str) -> float:
    """Seconds of one short forward pass: on the CPU it pages in the memory-mapped weights,
    which both loaders leave for first use."""
    ids = torch.arange(1, 9, device=device).unsqueeze(0)
    with torch.no_grad():
        seconds, _ = timed(lambda: model(ids), device)
    return seconds


def bench_cold(folder: Path, device: str, runs: int, tick: Callable[[], None]) -> dict[str, Any]:
    hub = HubPath(folder, device)
    times: dict[str, list[float]] = {"hub": [], "baseline": [], "from_pretrained": []}
    forward: dict[str, list[float]] = {"hub": [], "from_pretrained": []}
    for run in range(runs):
        order = ["hub", "baseline", "from_pretrained"]
        if run % 2:
            order.reverse()
        for which in order:
            if which == "hub":
                seconds, loaded = timed(hub.load, device)
                if isinstance(loaded, torch.nn.Module):
                    forward["hub"].append(first_forward(loaded, device))
                hub.unload(loaded)
            elif which == "baseline":
                seconds, loaded = timed(lambda: baseline_load(folder, device), device)
            else:
                seconds, loaded = timed(lambda: reference_load(folder, device), device)
                forward["from_pretrained"].append(first_forward(loaded, device))
            del loaded
            times[which].append(seconds)
            tick()
    summary = summarise(times, "hub", "baseline")
    summary["first_forward_median_s"] = {k: statistics.median(v) for k, v in forward.items() if v}
    return {"path": hub.name, **summary}


def bench_warm(folder: Path, device: str, runs: int, tick: Callable[[], None]) -> dict[str, Any]:
    model = load_causal_lm(folder, device)
    with torch.no_grad():
        expected = model(torch.tensor([[1, 2, 3, 4]], device=device)).logits
    times: dict[str, list[float]] = {"restore": [], "copy": [], "offload": []}
    parked: ParkedWeights = park(model)
    nbytes, pinned = parked.nbytes, parked.pinned
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    source.fill_(1)  # touched, like the parked buffer

    def copy() -> torch.Tensor:
        block = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return block.copy_(source, non_blocking=pinned)

    for run in range(runs):
        order = ["restore", "copy"] if run % 2 == 0 else ["copy", "restore"]
        for which in order:
            if which == "restore":
                seconds, _ = timed(partial(parked.restore, device), device)
                times["restore"].append(seconds)
                seconds, parked = timed(partial(park, model), device)
                times["offload"].append(seconds)
            else:
                seconds, block = timed(copy, device)
                del block
                times["copy"].append(seconds)
            tick()
    parked.restore(device)
    with torch.no_grad():
        same = torch.equal(model(torch.tensor([[1, 2, 3, 4]], device=device)).logits, expected)
    return {
        "bytes": nbytes,
        "pinned_host_memory": parked.pinned,
        "outputs_identical_after_restores": bool(same),
        **summarise(times, "restore", "copy"),
    }


def summarise(times: dict[str, list[float]], hub: str, baseline: str) -> dict[str, Any]:
    """Medians and their ratio (the headline), plus the best runs and theirs: on a busy
    machine the best run is the one least disturbed by others."""
    medians = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    return {
        "seconds": times,
        "median_s": medians,
        "best_s": best,
        "ratio": medians[hub] / medians[baseline],
        "ratio_of_best": best[hub] / best[baseline],
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cold, warm = result["cold_load"], result["warm_restore"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    panels = [
        (axes[0], cold, ["baseline", "hub", "from_pretrained"],
         ["load_file +\nbuild (meta)", "hub load", "from_pretrained"],
         f"Cold load: hub / baseline = {cold['ratio']:.2f}x (goal <= {GOALS['cold_load_ratio']}x)"),
        (axes[1], warm, ["copy", "restore", "offload"],
         ["plain copy\nsame bytes", "hub restore", "hub offload"],
         f"Warm restore: hub / copy = {warm['ratio']:.2f}x (goal <= "
         f"{GOALS['warm_restore_ratio']}x)"),
    ]  # fmt: skip
    for ax, data, keys, labels, title in panels:
        medians = [data["median_s"][k] * 1000 for k in keys]
        lows = [m - min(data["seconds"][k]) * 1000 for m, k in zip(medians, keys, strict=True)]
        highs = [max(data["seconds"][k]) * 1000 - m for m, k in zip(medians, keys, strict=True)]
        colors = ["#9aa5b1", "#3b6fd8", "#c9a227"]
        ax.bar(labels, medians, yerr=[lows, highs], capsize=4, color=colors)
        for i, m in enumerate(medians):
            ax.text(i, m, f"{m:.0f} ms", ha="center", va="bottom", fontsize=9)
        ax.set_title(title, fontsize=9.5)
        ax.set_ylabel("milliseconds (median, min-max)")
    model = result["model"]
    fig.suptitle(
        f"Model swaps, {model['parameters'] / 1e6:.0f}M-parameter Llama "
        f"({model['bytes'] / 2**20:.0f} MiB) on {result['device']}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--runs", type=int, default=None, help="repeats (default 9, quick 3)")
    parser.add_argument("--params", type=int, default=None, help="model size (default 100M)")
    parser.add_argument("--quick", action="store_true", help="25M model, 3 runs, -quick files")
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a built model")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    runs = args.runs or (3 if args.quick else 9)
    params = args.params or (25_000_000 if args.quick else 100_000_000)

    from tqdm import tqdm

    with tempfile.TemporaryDirectory(prefix="hub-swap-") as tmp:
        folder = args.model_dir or build_benchmark_llm(Path(tmp) / "llama", target_params=params)
        probe = load_causal_lm(folder, "cpu")
        model_info = {
            "parameters": sum(p.numel() for p in probe.parameters()),
            "bytes": module_bytes(probe),
            "dtype": str(next(probe.parameters()).dtype),
        }
        del probe
        with tqdm(total=5 * runs, desc="swap benchmark", unit="step") as bar:
            cold = bench_cold(folder, args.device, runs, bar.update)
            warm = bench_warm(folder, args.device, runs, bar.update)
    result = {
        "benchmark": "swap",
        "device": args.device,
        "runs": runs,
        "model": model_info,
        "cold_load": cold,
        "warm_restore": warm,
        "goals": GOALS,
        "meets_goals": {
            "cold_load": cold["ratio"] <= GOALS["cold_load_ratio"],
            "warm_restore": warm["ratio"] <= GOALS["warm_restore_ratio"],
        },
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(args.device) if args.device != "cpu" else None,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "swap-quick" if args.quick else "swap"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / f"{stem}.png")
    ms = {k: {n: v * 1000 for n, v in r["median_s"].items()} for k, r in (("c", cold), ("w", warm))}
    print(
        f"cold load {ms['c']['hub']:.0f} ms vs {ms['c']['baseline']:.0f} ms baseline: "
        f"{cold['ratio']:.2f}x (goal {GOALS['cold_load_ratio']}x); warm restore "
        f"{ms['w']['restore']:.0f} ms vs {ms['w']['copy']:.0f} ms copy: {warm['ratio']:.2f}x "
        f"(goal {GOALS['warm_restore_ratio']}x) -> {args.out / stem}.json, .png"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
