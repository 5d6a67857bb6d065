"""Usage metering overhead: request latency with metering on and off, side by side.

Two hubs run in this process, alike but for `usage.enabled`, each on its own SQLite
database (the embedded default: every answered request waits for its group commit), serving
the same tiny embedder. Requests go to them in-process (httpx's ASGI transport, no sockets)
in alternating blocks, ABBA-ordered (off, on, on, off, ...) so a shared machine's drift
cancels; at concurrency 1 every request pays a whole commit, at higher concurrency requests
share commits. Reported per load: the median latency in each mode and the difference of
medians (p50 added), and how many requests each commit carried.

    python benchmarks/usage_overhead.py             # concurrency 1 and 8, 8 blocks of 100
    python benchmarks/usage_overhead.py --quick     # a smoke run

Results go to `benchmarks/results/usage_overhead.json` (`usage_overhead-quick.json`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

RESULTS = REPO / "benchmarks" / "results"
BODY = {"model": "emb", "input": ["the harbour town woke slowly on winter mornings"]}


def settings(root: Path, mlflow_db: Path, *, metering: bool) -> Any:
    from hub.settings import HubSettings

    root.mkdir(parents=True)
    return HubSettings(
        database_url=f"sqlite:///{root / 'hub.db'}",
        mlflow_tracking_uri=f"sqlite:///{mlflow_db}",
        cache_dir=root / "cache",
        demo_dir=root / "demo",
        devices=[{"name": "cpu", "memory_budget": "1GiB"}],
        host_cache_budget="256MiB",
        encoder_worker_processes=False,
        usage={"enabled": metering},
    )


async def block(client: Any, n: int, concurrency: int) -> list[float]:
    """`n` requests at `concurrency`, each latency in seconds."""
    latencies: list[float] = []
    left = iter(range(n))

    async def worker() -> None:
        for _ in left:
            start = time.perf_counter()
            r = await client.post("/v1/embeddings", json=BODY)
            latencies.append(time.perf_counter() - start)
            assert r.status_code == 200, r.text

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


async def run(blocks: int, per_block: int, loads: list[int]) -> dict[str, Any]:
    import httpx

    from backends.tiny import build_tiny_embedder
    from hub.app import create_app
    from registry.mlflow_store import MlflowStore

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_embedder(root / "emb")
        template = root / "mlflow.db"
        MlflowStore(f"sqlite:///{template}").ping()
        apps = {}
        for mode in ("off", "on"):
            mlflow_db = root / f"mlflow-{mode}.db"
            mlflow_db.write_bytes(template.read_bytes())
            apps[mode] = create_app(settings(root / mode, mlflow_db, metering=mode == "on"))
        results: dict[str, Any] = {}
        async with (
            apps["off"].router.lifespan_context(apps["off"]),
            apps["on"].router.lifespan_context(apps["on"]),
        ):
            clients = {
                mode: httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://h")
                for mode, app in apps.items()
            }
            for client in clients.values():
                body = {"name": "emb", "kind": "embedder", "source": str(model)}
                r = await client.post("/admin/registry/models", json=body)
                assert r.status_code == 201, r.text
                await block(client, 50, 1)  # load and warm up
            meter = apps["on"].state.hub.usage
            for concurrency in loads:
                latencies: dict[str, list[float]] = {"off": [], "on": []}
                commits_before = meter.metrics.commits.labels("ok")._value.get()
                requests_before = _requests(apps["on"])
                for i in range(blocks):
                    order = ("off", "on") if i % 2 == 0 else ("on", "off")
                    for mode in order:
                        latencies[mode] += await block(clients[mode], per_block, concurrency)
                commits = meter.metrics.commits.labels("ok")._value.get() - commits_before
                requests = _requests(apps["on"]) - requests_before
                p50 = {m: statistics.median(v) * 1000 for m, v in latencies.items()}
                results[f"concurrency {concurrency}"] = {
                    "requests_per_mode": len(latencies["on"]),
                    "p50_ms_off": round(p50["off"], 3),
                    "p50_ms_on": round(p50["on"], 3),
                    "p50_added_ms": round(p50["on"] - p50["off"], 3),
                    "requests_per_commit": round(requests / max(commits, 1), 2),
                }
                print(f"concurrency {concurrency}: {results[f'concurrency {concurrency}']}")
            for client in clients.values():
                await client.aclose()
    return results


def _requests(app: Any) -> float:
    counter = app.state.hub.usage.metrics.counters["requests"]
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    blocks, per_block = (2, 20) if args.quick else (8, 100)
    results = asyncio.run(run(blocks, per_block, [1, 8]))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("usage_overhead-quick.json" if args.quick else "usage_overhead.json")
    doc = {"machine": platform.platform(), "python": platform.python_version(), **results}
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
