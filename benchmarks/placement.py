"""Placement: six models on three replicas that each fit two, requests round-robin across
the replicas (a load balancer that knows nothing of models), with placement off and on.

A throwaway PostgreSQL, an MLflow server and three `hub serve` replicas on loopback
(benchmarks/launch/cluster.py); six embedders (7 MiB of weights, charged 39 MiB with the
encoder's runtime reserve; the same random weights under six names) on replicas whose CPU
budget holds two of them and not three (the shared test cluster's budget). Every replica's
local cache is filled first (each model loaded and unloaded once on each replica), so neither
arm pays downloads.
Then, for each arm (`replica.placement` false / true), the replicas restart empty and one
client sends `--requests` embeddings one after another, request i to replica i % 3, the
model drawn by a seeded random source (the same sequence in both arms).

It reports, per arm: model loads (cold and warm restores, summed over replicas from
`hub_model_loads_total`), loads per request after the first `--warm-up` requests, p50/p99
latency after warm-up, errors, and how many answers another replica than the one asked
served (`X-Hub-Replica`). Goal: with placement, at most 5% of requests after warm-up cause a
load. Results: `benchmarks/results/placement.json` and `.png`.

    python benchmarks/placement.py                 # 300 requests per arm, 60 warm-up
    python benchmarks/placement.py --requests 120 --warm-up 30
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python benchmarks/<name>.py` from anywhere
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
from tqdm import tqdm  # noqa: E402

from backends.tiny import build_tiny_embedder  # noqa: E402
from benchmarks.launch.cluster import Cluster, running_cluster, wait_for  # noqa: E402
from benchmarks.launch.round_robin import (  # noqa: E402  # noqa: E402
    PLACEMENT_MODELS,
    Answer,
    build_placement_embedder,
    loads,
    placement_budget,
    replica_ids,
    round_robin,
)

RESULTS = REPO / "benchmarks" / "results"
ARMS = (("off", "false"), ("on", "true"))
SAMPLE_EVERY = 10  # requests between two readings of the load counters (for the curve)


def _config(embedder: Path, small: Path) -> dict[str, Any]:
    return {
        "cache_dir": ".hub/cache",
        "devices": [{"name": "cpu", "memory_budget": placement_budget(embedder, small)}],
        "log_level": "warning",
        "models": [
            {"name": m, "kind": "embedder", "source": str(embedder)} for m in PLACEMENT_MODELS
        ],
        "replica": {"heartbeat_interval": 0.5, "expire_after": 2.0},
    }


def _fill_caches(cluster: Cluster) -> None:
    """Each model loaded and unloaded once on every replica: downloads out of the way."""
    with httpx.Client(timeout=300) as client:
        for base in tqdm(cluster.bases, desc="filling caches"):
            for m in PLACEMENT_MODELS:
                for action in ("load", "unload"):
                    r = client.post(f"{base}/admin/models/{m}/versions/1/{action}")
                    r.raise_for_status()


def _restart(cluster: Cluster, placement: str) -> None:
    for replica in cluster.replicas:
        replica.env = {**replica.env, "HUB_REPLICA__PLACEMENT": placement}
        replica.stop()
    for replica in cluster.replicas:
        replica.spawn()
    deadline = time.monotonic() + 300
    for replica in cluster.replicas:
        replica.wait_ready(deadline)
    expected = len(cluster.replicas)

    def whole(base: str) -> bool:
        return len(httpx.get(f"{base}/admin/replicas", timeout=10).json()["replicas"]) == expected

    for base in cluster.bases:
        wait_for(lambda b=base: whole(b), f"{base} does not list every replica")  # type: ignore[misc]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _arm(cluster: Cluster, name: str, requests: int, warm_up: int, seed: int) -> dict[str, Any]:
    ids = replica_ids(cluster)
    curve: list[tuple[int, int]] = [(0, loads(cluster, PLACEMENT_MODELS))]
    at_warm_up: list[int] = []
    bar = tqdm(total=requests, desc=f"placement {name}")

    def seen(answer: Answer) -> None:
        bar.update(1)
        done = answer.index + 1
        if done == warm_up:
            at_warm_up.append(loads(cluster, PLACEMENT_MODELS))
        if done % SAMPLE_EVERY == 0 or done == requests:
            curve.append((done, loads(cluster, PLACEMENT_MODELS)))

    answers = round_robin(cluster, PLACEMENT_MODELS, requests, seed=seed, on_answer=seen)
    bar.close()
    total = curve[-1][1] - curve[0][1]
    after = curve[-1][1] - (at_warm_up[0] if at_warm_up else curve[0][1])
    measured = [a for a in answers if a.index >= warm_up]
    latencies = [a.seconds * 1000 for a in measured if a.status == 200]
    p50, p99 = _percentile(latencies, 0.50), _percentile(latencies, 0.99)
    return {
        "placement": name == "on",
        "requests": requests,
        "warm_up": warm_up,
        "loads": total,
        "loads_after_warm_up": after,
        "load_fraction_after_warm_up": round(after / max(1, len(measured)), 4),
        "p50_ms": round(p50, 1) if p50 is not None else None,
        "p99_ms": round(p99, 1) if p99 is not None else None,
        "mean_ms": round(statistics.fmean(latencies), 1) if latencies else None,
        "errors": sum(a.status != 200 for a in answers),
        "served_elsewhere": sum(a.served_by != ids[a.asked] for a in answers),
        "loads_curve": [{"requests": n, "loads": c - curve[0][1]} for n, c in curve],
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = report["arms"]
    fig, (curve, lat) = plt.subplots(1, 2, figsize=(12, 4.4))
    for name, arm in arms.items():
        xs = [p["requests"] for p in arm["loads_curve"]]
        ys = [p["loads"] for p in arm["loads_curve"]]
        curve.plot(xs, ys, marker=".", label=f"placement {name}: {arm['loads']} loads")
    curve.axvline(report["warm_up"], color="grey", linestyle="--", label="end of warm-up")
    curve.set_xlabel("requests (round-robin over 3 replicas)")
    curve.set_ylabel("model loads, all replicas")
    curve.legend()
    names = list(arms)
    slots = range(len(names))
    lat.bar([x - 0.2 for x in slots], [arms[n]["p50_ms"] or 0 for n in names], 0.4, label="p50")
    lat.bar([x + 0.2 for x in slots], [arms[n]["p99_ms"] or 0 for n in names], 0.4, label="p99")
    lat.set_xticks(list(slots), [f"placement {n}" for n in names])
    lat.set_ylabel("latency after warm-up (ms)")
    lat.legend()
    fig.suptitle(
        f"Six models, three replicas fitting two each, {report['requests']} round-robin requests"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per arm")
    parser.add_argument("--warm-up", type=int, default=60, help="requests not measured")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="placement-bench-") as tmp:
        root = Path(tmp)
        embedder = build_placement_embedder(root / "embedder")
        small = build_tiny_embedder(root / "small")
        config = _config(embedder, small)
        with running_cluster(root, config, env={"HUB_REPLICA__PLACEMENT": "false"}) as cluster:
            _fill_caches(cluster)
            arms = {}
            for name, flag in ARMS:
                _restart(cluster, flag)
                arms[name] = _arm(cluster, name, args.requests, args.warm_up, args.seed)
    report = {
        "requests": args.requests,
        "warm_up": args.warm_up,
        "seed": args.seed,
        "replicas": 3,
        "models": len(PLACEMENT_MODELS),
        "budget_bytes": config["devices"][0]["memory_budget"],
        "arms": arms,
        "goal": {
            "at_most_5_percent_loads_after_warm_up": arms["on"]["load_fraction_after_warm_up"]
            <= 0.05,
            "no_errors": arms["on"]["errors"] == 0,
        },
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average": os.getloadavg(),
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "placement.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out / "placement.png")
    summary = {n: {k: v for k, v in a.items() if k != "loads_curve"} for n, a in arms.items()}
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out / 'placement.json'} and .png")


if __name__ == "__main__":
    main()
