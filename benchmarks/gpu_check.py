"""The one prepared GPU run: the hub's engine, manager and encoders against transformers and
sentence-transformers on one device, under one overall deadline.

    python benchmarks/gpu_check.py --out DIR                     # one GPU, at most ~6 min
    python benchmarks/gpu_check.py --out DIR --device cpu --small  # every section, toy sizes
    python benchmarks/gpu_check.py --out DIR --engine-config '{"cuda_graphs": false}'
    python3 benchmarks/gpu_check.py --out /tmp/gc --results "$OUT"  # on a lent machine

Each section (`sections()` below) runs in a child process of its own under
`timeout` = min(its budget, the time left), so a hang or a crashed CUDA context costs one
section, not the run; a section that fails records its error and the next one runs. Each
child writes its figures to DIR/sections/NAME.json as it measures them, and the parent merges
them into DIR/gpu_check.json after every section, so a run cut short still leaves what it
measured; the summary is printed at the end. DIR also holds the models the sections build
(gigabytes): `--results R` copies only gpu_check.json and a tarball of the sections' logs to R
after every section, which is what a lent machine should send back. `--engine-config` (JSON)
is handed to every engine the sections build (EngineConfig keys), so one command measures the
engine with and without a setting such as `cuda_graphs`.

A GPU machine without network runs this with the wheels it lacks carried in the checkout
(`benchmarks/gpu_wheels.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Seconds the whole run may take, and what each section may take of it (on a GPU; a CPU dry
# run with --small gets its own budgets). An H200 took 15-32 s a section (2026-11-27).
TOTAL_S = 360
SMALL_TOTAL_S = 590


def sections() -> dict[str, tuple[Callable[[Any], None], float, float]]:
    """name -> (function, budget on a GPU, budget of a --small CPU run), in running order."""
    from benchmarks import gpu_llm
    from benchmarks import gpu_sections as g

    return {
        "environment": (g.environment, 20, 60),
        "throughput": (gpu_llm.throughput, 45, 115),
        "latency": (gpu_llm.latency, 40, 70),
        "hf_static": (gpu_llm.hf_static, 30, 50),
        "hf_cb": (gpu_llm.hf_cb, 35, 60),
        "hf_cb_graphs": (gpu_llm.hf_cb_graphs, 40, 20),
        "correctness": (g.correctness, 35, 80),
        "restore": (gpu_llm.restore, 25, 50),
        "embeddings": (gpu_llm.embeddings, 30, 40),
        "footprint": (g.footprint, 25, 40),
        "cuda_tests": (g.cuda_tests, 35, 5),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json")
    p.add_argument("--device", default=None, help="cuda:0 (default when CUDA is there) or cpu")
    p.add_argument("--small", action="store_true", help="toy sizes (a CPU dry run)")
    p.add_argument("--engine-config", default="{}", help="JSON of EngineConfig keys")
    p.add_argument(
        "--results",
        type=Path,
        default=None,
        help="also copy gpu_check.json and the logs here after each section",
    )
    p.add_argument("--only", default="", help="comma-separated sections to run (default all)")
    p.add_argument("--total", type=float, default=None, help="overall deadline in seconds")
    p.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="SECTION=SECONDS",
        help="a section's own limit instead of its default (repeatable)",
    )
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)  # a child's one section
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def default_device() -> str:
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def run_child(args: argparse.Namespace) -> int:
    """One section in this process: its figures go to DIR/sections/NAME.json."""
    from benchmarks.gpu_sections import Context

    ctx = Context(
        out=args.out,
        device=args.device,
        small=args.small,
        engine_config=json.loads(args.engine_config),
        deadline=args.deadline or time.time() + 600,
        section=args.section,
    )
    function = sections()[args.section][0]
    try:
        function(ctx)
    except Exception as e:
        ctx.error("section", e)
        ctx.finish()
        return 1
    ctx.finish()
    return 0


def merge(out: Path, meta: dict[str, Any], results: Path | None = None) -> dict[str, Any]:
    """DIR/gpu_check.json from every section's file so far (written atomically); with
    `results`, that file and a tarball of the sections' logs copied there too."""
    merged: dict[str, Any] = {"run": meta, "sections": {}}
    for path in sorted((out / "sections").glob("*.json")):
        try:
            merged["sections"][path.stem] = json.loads(path.read_text())
        except ValueError as e:  # a child killed mid-write leaves no torn file (atomic), but
            merged["sections"][path.stem] = {"status": "unreadable", "error": str(e)}
    tmp = out / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, out / "gpu_check.json")
    if results is not None:
        results.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "gpu_check.json", results / "gpu_check.json")
        with tarfile.open(results / "gpu_check_logs.tgz.tmp", "w:gz") as tar:
            for log in sorted((out / "sections").glob("*.log")):
                tar.add(log, arcname=log.name)
        os.replace(results / "gpu_check_logs.tgz.tmp", results / "gpu_check_logs.tgz")
    return merged


def run_all(args: argparse.Namespace) -> int:
    from benchmarks.gpu_sections import summarise

    out: Path = args.out
    (out / "sections").mkdir(parents=True, exist_ok=True)
    start = time.time()
    total = args.total or (SMALL_TOTAL_S if args.small else TOTAL_S)
    end = start + total
    only = [s for s in args.only.split(",") if s]
    budgets = dict(b.split("=", 1) for b in args.budget)
    meta: dict[str, Any] = {"device": args.device, "small": args.small, "total_s": total,
                            "engine_config": json.loads(args.engine_config),
                            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)),
                            "sections": {}}  # fmt: skip
    for name, (_, budget, small_budget) in sections().items():
        if only and name not in only:
            continue
        left = end - time.time() - 3
        own = float(budgets[name]) if name in budgets else None
        limit = min(own or (small_budget if args.small else budget), left)
        if limit < 5:
            meta["sections"][name] = {"rc": None, "skipped": f"{left:.0f}s left"}
            print(f"=== {name}: skipped, {left:.0f}s left", flush=True)
            merge(out, meta, args.results)
            continue
        print(f"=== {name} (limit {limit:.0f}s) at +{time.time() - start:.0f}s", flush=True)
        command = [sys.executable, str(Path(__file__).resolve()), "--section", name,
                   "--out", str(out), "--device", args.device, "--engine-config",
                   args.engine_config, "--deadline", str(time.time() + limit - 3)]  # fmt: skip
        if args.small:
            command.append("--small")
        t0 = time.time()
        log = (out / "sections" / f"{name}.log").open("w")
        try:
            rc: int | None = subprocess.run(
                command, stdout=log, stderr=subprocess.STDOUT, timeout=limit, cwd=ROOT
            ).returncode
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            log.close()
        seconds = round(time.time() - t0, 1)
        meta["sections"][name] = {"rc": rc, "seconds": seconds, "timed_out": rc is None}
        print(f"=== {name}: rc={rc} after {seconds}s", flush=True)
        if rc != 0:
            tail = (out / "sections" / f"{name}.log").read_text(errors="replace")[-1500:]
            print(tail, flush=True)
        merge(out, meta, args.results)
    meta["seconds"] = round(time.time() - start, 1)
    merged = merge(out, meta, args.results)
    print(summarise(merged), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()
    if args.device is None:
        args.device = default_device()
    if args.section:
        return run_child(args)
    return run_all(args)


if __name__ == "__main__":
    raise SystemExit(main())
