"""The figure of benchmarks/overload.py: the admitted requests' p50/p99 of each run against 3x
the unloaded p99, and how many of each burst were admitted and shed."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if report["scenario"] == "demo":
        on, off = report["admission"], report["previous"]
        unloaded = on["unloaded"]
        bursts = [(f"burst,\nmax_queue_time_ms={report['max_queue_time_ms']:g}", on["burst"]),
                  ("burst,\nbound off (previous)", off["burst"])]  # fmt: skip
        runs = [("unloaded", unloaded), *bursts, ("burst,\nall 404 (floor)", report["http_floor"])]
        title = (f"A burst of {report['burst']} chat completions + embeddings on the demo "
                 f"config ({report['client']} client, compute threads "
                 f"{report['compute_threads'] or 'default'})")  # fmt: skip
    else:
        unloaded = report["unloaded"]
        bursts = [("burst, shedding", report["shedding"]),
                  ("burst, no shedding", report["absorbing"])]  # fmt: skip
        runs = [("unloaded", unloaded), *bursts, ("burst, all 404 (floor)", report["http_floor"])]
        title = (f"A burst of {report['burst']} mixed requests (embeddings + rerank), "
                 f"max_queue_time_ms={report['max_queue_time_ms']:g}, "
                 f"max_requests_in_progress={report['max_requests_in_progress']}, "
                 f"max_event_loop_lag={report['max_event_loop_lag']:g}s "
                 f"({report['client']} client)")  # fmt: skip
    fig, (lat, counts) = plt.subplots(1, 2, figsize=(13, 4.6))
    xs = range(len(runs))
    p50 = [r["p50_ms"] or r["answer_p50_ms"] or 0 for _, r in runs]
    p99 = [r["p99_ms"] or r["answer_p99_ms"] or 0 for _, r in runs]
    lat.bar([x - 0.2 for x in xs], p50, 0.4, label="p50")
    lat.bar([x + 0.2 for x in xs], p99, 0.4, label="p99")
    goal = 3 * (unloaded["p99_ms"] or 0)
    lat.axhline(goal, color="grey", linestyle="--", label="3x unloaded p99")
    lat.set_xticks(list(xs), [n for n, _ in runs], fontsize=8)
    lat.set_yscale("log")
    lat.set_ylabel("latency of admitted requests (ms); floor: of the 404s")
    lat.legend()
    bx = range(len(bursts))
    counts.bar(bx, [r["admitted"] for _, r in bursts], label="admitted (200)")
    counts.bar(bx, [r["shed"] for _, r in bursts], bottom=[r["admitted"] for _, r in bursts],
               label="shed (503 + Retry-After)")  # fmt: skip
    counts.set_xticks(list(bx), [n for n, _ in bursts], fontsize=8)
    counts.set_ylabel("requests")
    counts.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
