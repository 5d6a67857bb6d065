"""Shadow traffic overhead: the primary's latency with its shadow on and off, side by side.

A real `hub serve` process serves two registered versions of one embedder: v1 production and
v2 (MiniLM by default, registered twice, as only one MiniLM is shipped; or two tiny
embedders of different seeds). This process drives it over HTTP in alternating blocks of
requests, ABBA-ordered (off, on, on, off, ...): in "off" blocks the traffic policy is 100% v1
and nothing else; in "on" blocks v2 shadows 100% of requests. Before each block the shadow
queue is left to drain, so a block's mirrors do not spill into the next. Each ABBA quadruple
gives one on/off ratio of median latencies a few seconds apart, which cancels the slow drift
of a shared machine; their median (and quartiles) is the figure to quote. It also checks
that every response body is byte-identical in both modes (under concurrency, where batch
composition alone changes the last bits, that mirroring adds no difference beyond it) and
records what the shadow did (mirrored, dropped, similarity, replay latency). Loads are
CONCURRENCY:THINK_MS: a think time of 0 saturates the hub (closed loop), a longer one leaves
idle gaps between requests.

    python benchmarks/shadow_overhead.py                 # MiniLM; loads 1:0, 1:50, 4:0
    python benchmarks/shadow_overhead.py --quick         # a smoke run (tiny embedder)
    python benchmarks/shadow_overhead.py --eager         # also without shadow_when_idle

Results go to `benchmarks/results/shadow_overhead.json` and `.png` (`shadow_overhead-quick.*` with
`--quick`).
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python benchmarks/<name>.py` from anywhere
    sys.path.insert(0, str(REPO))

from benchmarks.launch.process import hub_config, hub_process  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
MODEL = "emb"

_VOCABULARY = (
    "the a of to and in is for on that with as was by at from it model memory request batch "
    "token cache server query answer document search harbour ferry morning evening weather "
    "market price river mountain village music library garden kitchen window doctor teacher"
)
_WORDS = _VOCABULARY.split()


def make_sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choices(_WORDS, k=rng.randint(6, 30))).capitalize() + "." for _ in range(n)
    ]


def model_sources(kind: str, root: Path) -> tuple[str, str]:
    """Folders of v1 and v2: MiniLM and MiniLM again (other weights are not shipped; the same
    weights cost the same, which is what is measured), or two tiny embedders."""
    if kind == "minilm":
        from hub.demo import minilm_dir

        folder = str(minilm_dir())
        return folder, folder
    from backends.tiny import build_tiny_embedder

    return (
        str(build_tiny_embedder(root / "tiny-v1", seed=0)),
        str(build_tiny_embedder(root / "tiny-v2", seed=1)),
    )


@contextmanager
def hub_server(root: Path, env: dict[str, str]) -> Iterator[str]:
    """`hub serve` on a fresh SQLite registry under `root`; yields its base URL."""
    with hub_process(hub_config(root), cwd=root, env=env, timeout=300) as (base, _):
        yield base


def _ok(r: Any) -> Any:
    if r.status_code >= 400:
        raise RuntimeError(f"{r.request.method} {r.request.url}: {r.status_code} {r.text}")
    return r.json()


def prepare(base: str, v1: str, v2: str) -> None:
    import httpx

    with httpx.Client(base_url=base, timeout=300) as c:
        for source, aliases in ((v1, ["production"]), (v2, [])):
            body = {"name": MODEL, "kind": "embedder", "source": source, "aliases": aliases}
            _ok(c.post("/admin/registry/models", json=body))
        for version in (1, 2):  # both resident before anything is timed
            _ok(c.post(f"/admin/models/{MODEL}/versions/{version}/load"))


async def set_shadow(client: Any, on: bool) -> None:
    body: dict[str, Any] = {"splits": [{"version": 1, "weight": 100}]}
    if on:
        body["shadow"] = {"version": 2, "percent": 100}
    _ok(await client.put(f"/admin/traffic/{MODEL}", json=body))


async def drained(client: Any) -> None:
    """Wait until the hub has no mirror queued and the last one has finished."""
    for _ in range(600):
        shadow = _ok(await client.get(f"/admin/traffic/{MODEL}/readout"))["shadow"]
        if shadow is None or shadow["queued"] == 0:
            await asyncio.sleep(0.2)  # the job a worker holds is no longer queued
            return
        await asyncio.sleep(0.1)
    raise TimeoutError("shadow queue did not drain")


async def block(
    client: Any, sentences: list[str], concurrency: int, think_s: float = 0.0
) -> tuple[list[float], dict[int, bytes]]:
    """Send every sentence once, `concurrency` at a time, each worker pausing `think_s`
    after each answer (0: a saturating closed loop); latencies and bodies by index."""
    latencies: list[float] = []
    bodies: dict[int, bytes] = {}
    todo = iter(range(len(sentences)))

    async def worker() -> None:
        for i in todo:
            start = time.perf_counter()
            r = await client.post("/v1/embeddings", json={"model": MODEL, "input": sentences[i]})
            latencies.append(time.perf_counter() - start)
            if r.status_code != 200:
                raise RuntimeError(f"request failed: {r.status_code} {r.text}")
            bodies[i] = r.content
            if think_s:
                await asyncio.sleep(think_s)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, bodies


def _vectors(bodies: dict[int, bytes]) -> np.ndarray:
    return np.array(
        [json.loads(bodies[i])["data"][0]["embedding"] for i in sorted(bodies)], dtype=np.float64
    )


def identity(bodies_by_mode: dict[str, list[dict[int, bytes]]]) -> dict[str, Any]:
    """Did mirroring change any primary answer? Byte-identical bodies in every block settle
    it. Concurrent requests share batches whose composition (and so padding, and the float
    rounding of the forward pass) differs from block to block, so under concurrency bodies
    may differ in the last bits whether or not a shadow runs; then the largest difference
    between an "on" block and the first "off" block is compared with the largest between two
    "off" blocks: mirroring changes nothing if the first is no larger than the second."""
    off, on = bodies_by_mode["off"], bodies_by_mode["on"]
    reference = off[0]
    identical = all(b == reference for b in off[1:] + on)
    report: dict[str, Any] = {"byte_identical": identical}
    if not identical:
        ref = _vectors(reference)
        report["max_abs_diff_off_vs_off"] = max(
            (float(np.abs(_vectors(b) - ref).max()) for b in off[1:]), default=0.0
        )
        report["max_abs_diff_on_vs_off"] = max(float(np.abs(_vectors(b) - ref).max()) for b in on)
        report["shadow_changed_answers"] = (
            report["max_abs_diff_on_vs_off"] > report["max_abs_diff_off_vs_off"]
        )
    else:
        report["shadow_changed_answers"] = False
    return report


def summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {
        "n": len(ordered),
        "p50_ms": pick(0.50) * 1e3,
        "p95_ms": pick(0.95) * 1e3,
        "mean_ms": statistics.fmean(ordered) * 1e3,
    }


async def shadow_outcomes(client: Any) -> dict[str, int]:
    """The hub's shadow outcome counters (cumulative since it started)."""
    shadow = _ok(await client.get(f"/admin/traffic/{MODEL}/readout"))["shadow"]
    return dict(shadow["versions"][0]["outcomes"]) if shadow and shadow["versions"] else {}


async def measure(
    base: str, sentences: list[str], blocks: int, concurrency: int, think_s: float
) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        await set_shadow(client, False)
        await block(client, sentences[:20], concurrency)  # warm-up, untimed
        before = await shadow_outcomes(client)
        modes = ["off", "on", "on", "off"] * ((blocks + 3) // 4)
        runs: dict[str, list[float]] = {"off": [], "on": []}
        per_block: list[dict[str, Any]] = []
        bodies_by_mode: dict[str, list[dict[int, bytes]]] = {"off": [], "on": []}
        for mode in modes[:blocks]:
            await set_shadow(client, mode == "on")
            await drained(client)
            latencies, bodies = await block(client, sentences, concurrency, think_s)
            runs[mode] += latencies
            row: dict[str, Any] = {"mode": mode, **summary(latencies)}
            if mode == "on":  # this block's mirrors (the readout restarts at each PUT)
                await drained(client)
                readout = _ok(await client.get(f"/admin/traffic/{MODEL}/readout"))
                [shadow] = readout["shadow"]["versions"]
                row["shadow"] = {k: shadow[k] for k in ("mirrored", "similarity", "latency_ms")}
            per_block.append(row)
            bodies_by_mode[mode].append(bodies)
        await drained(client)
        after = await shadow_outcomes(client)
    off, on = summary(runs["off"]), summary(runs["on"])
    # Each ABBA quadruple (off, on, on, off) is a side-by-side comparison a few seconds
    # long: the ratio of its "on" to its "off" block medians cancels the slow drift of a
    # shared machine; the median over quadruples is the figure to quote, the quartiles its
    # spread.
    quads = [per_block[i : i + 4] for i in range(0, len(per_block) - 3, 4)]
    quad_ratios = sorted(
        statistics.fmean(b["p50_ms"] for b in q if b["mode"] == "on")
        / statistics.fmean(b["p50_ms"] for b in q if b["mode"] == "off")
        for q in quads
    )
    quartiles = statistics.quantiles(quad_ratios, n=4) if len(quad_ratios) > 1 else []
    q1, q3 = (quartiles[0], quartiles[2]) if quartiles else (quad_ratios[0], quad_ratios[0])
    outcomes = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {
        "concurrency": concurrency,
        "think_ms": think_s * 1000,
        "off": off,
        "on": on,
        "ratio_p50": on["p50_ms"] / off["p50_ms"],
        "ratio_p95": on["p95_ms"] / off["p95_ms"],
        "ratio_mean": on["mean_ms"] / off["mean_ms"],
        "ratio_p50_abba_median": statistics.median(quad_ratios),
        "ratio_p50_abba_quartiles": [q1, q3],
        "abba_ratios": quad_ratios,
        **identity(bodies_by_mode),
        # Mirrors of this run by outcome (ok, dropped_full, dropped_stale, error), of
        # sum(requests of "on" blocks) offered.
        "shadow_outcomes": outcomes,
        "blocks": per_block,
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    labels = list(dict.fromkeys(run["label"] for run in runs))  # one row per configuration
    cols = max(sum(1 for run in runs if run["label"] == label) for label in labels)
    fig, axes = plt.subplots(
        len(labels), cols, figsize=(5.5 * cols, 4 * len(labels)), squeeze=False
    )
    placed: dict[str, int] = {}
    for run in runs:
        row = labels.index(run["label"])
        ax = axes[row][placed.setdefault(run["label"], 0)]
        placed[run["label"]] += 1
        for mode, color in (("off", "#3b6fd8"), ("on", "#c53030")):
            xs = [i for i, b in enumerate(run["blocks"]) if b["mode"] == mode]
            ax.plot(
                xs,
                [run["blocks"][i]["p50_ms"] for i in xs],
                "o",
                color=color,
                label=f"shadow {mode}: p50 {run[mode]['p50_ms']:.2f} ms",
            )
        ax.set_title(
            f"{run['label']}, c={run['concurrency']}, think {run['think_ms']:g} ms: "
            f"ABBA p50 ratio {run['ratio_p50_abba_median']:.3f}",
            fontsize=9,
        )
        ax.set_xlabel("block (ABBA order)")
        ax.set_ylabel("primary p50 latency per block (ms)")
        ax.legend(fontsize=8)
    fig.suptitle(f"Primary latency with a 100% shadow vs none ({report['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["minilm", "tiny"], default="minilm")
    parser.add_argument("--requests", type=int, default=25, help="requests per block")
    parser.add_argument("--blocks", type=int, default=40, help="blocks (ABBA: a multiple of 4)")
    parser.add_argument(
        "--load",
        nargs="+",
        default=["1:0", "1:50", "4:0"],
        help="CONCURRENCY:THINK_MS per run; think 0 saturates the hub (a closed loop)",
    )
    parser.add_argument(
        "--eager", action="store_true", help="also run without traffic.shadow_when_idle"
    )
    parser.add_argument("--quick", action="store_true", help="tiny embedder, few blocks")
    args = parser.parse_args()
    if args.quick:
        args.model, args.requests, args.blocks, args.load = "tiny", 40, 4, ["1:0"]
    loads = [(int(c), float(t) / 1000) for c, t in (x.split(":") for x in args.load)]
    sentences = make_sentences(args.requests)
    configs = [("idle-wait (default)", {})]
    if args.eager:
        configs.append(("eager", {"HUB_TRAFFIC__SHADOW_WHEN_IDLE": "false"}))
    runs = []
    for label, env in configs:
        with tempfile.TemporaryDirectory(prefix="hub-shadow-bench-") as tmp:
            root = Path(tmp)
            v1, v2 = model_sources(args.model, root)
            with hub_server(root, env) as base:
                prepare(base, v1, v2)
                for concurrency, think_s in loads:
                    run = asyncio.run(measure(base, sentences, args.blocks, concurrency, think_s))
                    runs.append({"label": label, **run})
                    print(
                        f"{label:20} c={concurrency} think {think_s * 1000:g} ms: "
                        f"off p50 {run['off']['p50_ms']:.2f} ms, "
                        f"on p50 {run['on']['p50_ms']:.2f} ms, ABBA p50 ratio "
                        f"{run['ratio_p50_abba_median']:.3f} (quartiles "
                        f"{run['ratio_p50_abba_quartiles'][0]:.3f}-"
                        f"{run['ratio_p50_abba_quartiles'][1]:.3f}), pooled p50 "
                        f"{run['ratio_p50']:.3f} p95 {run['ratio_p95']:.3f} mean "
                        f"{run['ratio_mean']:.3f}; identical {run['byte_identical']} "
                        f"(shadow changed answers: {run['shadow_changed_answers']}); "
                        f"mirrors {run['shadow_outcomes']}",
                        flush=True,
                    )
    report = {
        "benchmark": "shadow_overhead",
        "model": args.model,
        "requests_per_block": args.requests,
        "blocks": args.blocks,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    # A smoke run (--quick) never replaces the measured results.
    out = RESULTS / ("shadow_overhead-quick" if args.quick else "shadow_overhead")
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and .png")


if __name__ == "__main__":
    main()
