"""Edge cost: the hub process's CPU per request for each kind of answer a burst gets.

A burst of hundreds of requests on a small machine is answered at the rate the HTTP edge
(uvicorn, the ingress, routing, error rendering) gets through them: what each answer costs
the hub's CPU decides how long the admitted requests queue behind the refused ones. One real
`hub serve` process (auth on, all-MiniLM-L6-v2 preloaded, its passes in a worker process as
by default) is sent, one kind at a time, `--connections` keep-alive connections each
sending the next request as soon as the last was answered, for `--seconds`, then as many
clients each sending one request per connection (`connection: close`, as the clients of a
burst do), for as long again:

- `not_found`: `/v1/embeddings` naming a model that does not exist (404), a valid key;
- `shed`: the edge's 503 + `Retry-After` (max_requests_in_progress reached: that many
  requests are held open, their bodies half sent, during this kind only);
- `rate_limited`: a key whose `requests_per_minute` is spent (429 + `Retry-After`);
- `unauthorized`: no key (401);
- `embeddings`: a small admitted embeddings request (one short sentence; 200).

Per kind and way of connecting: requests per second at saturation, and the CPU the hub
process (all its threads, from /proc/<pid>/stat; not the encoder's worker process) spent per
request, less what it spends idle over the same time; the client's own CPU per request
beside it (both share the machine's cores). Every answer's status is checked (and every
503 / 429 must carry `Retry-After`): a kind that got another answer fails the run.
`--profile KIND` runs py-spy (`--py-spy PATH`) on the hub during that kind and writes its
collapsed stacks next to the result. Results: `benchmarks/results/edge_cost.json` (`--out`).

    python benchmarks/edge_cost.py                      # every kind, 4 s each
    python benchmarks/edge_cost.py --kinds shed,not_found --seconds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python benchmarks/<name>.py` from anywhere
    sys.path.insert(0, str(REPO))

from benchmarks.launch.process import hub_config, hub_process  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
ADMIN_KEY = "edge-cost-admin-key"
EMBEDDER = "minilm"
# Held-open requests during `shed` (the in-progress bound); the other kinds use fewer
# connections than this, so the bound never refuses them.
MAX_IN_PROGRESS = 64
KINDS = ("not_found", "shed", "rate_limited", "unauthorized", "embeddings")
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Kind:
    """One kind of answer: the request sent (path, JSON body, key or None) and the status
    every answer must have."""

    path: str
    body: dict[str, Any]
    key: str | None
    status: int


def hub_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def encode(host: str, kind: Kind, close: bool) -> bytes:
    payload = json.dumps(kind.body).encode()
    auth = f"authorization: Bearer {kind.key}\r\n" if kind.key else ""
    connection = "connection: close\r\n" if close else ""
    return (
        f"POST {kind.path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"{auth}{connection}content-length: {len(payload)}\r\n\r\n"
    ).encode() + payload


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status and headers of one response (its Content-Length body read and dropped)."""
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionResetError("the hub closed the connection")
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    await reader.readexactly(int(headers["content-length"]))
    return int(status_line.split()[1]), headers


async def keep_sending(
    host: str,
    port: int,
    request: bytes,
    until: float,
    seen: Counter[tuple[int, bool]],
    close: bool,
) -> None:
    """Send `request` again and again until `until`, on one connection (`close` False) or
    each on a new one, closed after its answer (as a burst of clients sends them); count
    each answer as (status, whether it carried Retry-After)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < until:
            if close:
                writer.close()
                reader, writer = await asyncio.open_connection(host, port)
            writer.write(request)
            status, headers = await read_answer(reader)
            seen[status, "retry-after" in headers] += 1
    finally:
        writer.close()


async def hold_open(host: str, port: int, count: int) -> list[asyncio.StreamWriter]:
    """`count` embeddings requests with half their body sent: each stays in progress."""
    body = json.dumps({"model": EMBEDDER, "input": "held open"}).encode()
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {ADMIN_KEY}\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    writers = []
    for _ in range(count):
        _, writer = await asyncio.open_connection(host, port)
        writer.write(head + body[: len(body) // 2])
        writers.append(writer)
    await asyncio.sleep(0.5)  # each reached its route, waiting for the rest of its body
    return writers


async def measure(
    base: str, pid: int, kind: Kind, connections: int, seconds: float, idle_rate: float,
    close: bool,
) -> dict[str, Any]:  # fmt: skip
    host, port = base.removeprefix("http://").split(":")
    request = encode(f"{host}:{port}", kind, close)
    seen: Counter[tuple[int, bool]] = Counter()
    # A moment of warm-up on one connection: first-time paths (imports, caches) unmeasured.
    await keep_sending(host, int(port), request, time.perf_counter() + 0.3, Counter(), close)
    cpu0, client0, t0 = hub_cpu_s(pid), time.process_time(), time.perf_counter()
    until = t0 + seconds
    await asyncio.gather(
        *(keep_sending(host, int(port), request, until, seen, close) for _ in range(connections))
    )
    elapsed = time.perf_counter() - t0
    cpu = hub_cpu_s(pid) - cpu0 - idle_rate * elapsed
    client = time.process_time() - client0
    answered = sum(seen.values())
    wrong = {f"{s}{' +Retry-After' if r else ''}": n for (s, r), n in seen.items()
             if s != kind.status or (s in (429, 503)) != r}  # fmt: skip
    return {
        "status": kind.status,
        "answered": answered,
        "wrong_answers": wrong,
        "seconds": round(elapsed, 3),
        "requests_per_s": round(answered / elapsed, 1),
        "hub_cpu_ms_per_request": round(1000 * cpu / answered, 3),
        "client_cpu_ms_per_request": round(1000 * client / answered, 3),
    }


def _post(base: str, path: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    import httpx

    r = httpx.post(base + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    r.raise_for_status()
    result: dict[str, Any] = r.json()
    return result


def _kinds(base: str) -> dict[str, Kind]:
    """The requests of each kind, with the keys they need created through the admin API."""
    user = _post(base, "/admin/keys", {"name": "edge-user", "role": "user"}, ADMIN_KEY)["key"]
    limited = _post(
        base, "/admin/keys",
        {"name": "edge-limited", "role": "user", "limits": {"requests_per_minute": 1}},
        ADMIN_KEY,
    )["key"]  # fmt: skip
    missing = {"model": "no-such-model", "input": "hello"}
    return {
        "not_found": Kind("/v1/embeddings", missing, user, 404),
        "shed": Kind("/v1/embeddings", {"model": EMBEDDER, "input": "hello"}, user, 503),
        "rate_limited": Kind("/v1/embeddings", missing, limited, 429),
        "unauthorized": Kind("/v1/embeddings", missing, None, 401),
        "embeddings": Kind("/v1/embeddings", {"model": EMBEDDER, "input": "hello"}, user, 200),
    }


def _idle_rate(pid: int, seconds: float = 1.0) -> float:
    """CPU seconds per second the hub spends with no request (background tasks)."""
    cpu0 = hub_cpu_s(pid)
    time.sleep(seconds)
    return (hub_cpu_s(pid) - cpu0) / seconds


def _profiled(args: argparse.Namespace, pid: int, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [args.py_spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "250",
         "--duration", str(max(1, int(args.seconds))), "--output", str(out), "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def run_kinds(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="edge-cost-") as tmp:
        root = Path(tmp)
        models = [{"name": EMBEDDER, "kind": "embedder", "source": "builtin:minilm",
                   "preload": True}]  # fmt: skip
        config = hub_config(
            root, models,
            auth={"enabled": True, "bootstrap_admin_key": ADMIN_KEY},
            max_requests_in_progress=MAX_IN_PROGRESS,
        )  # fmt: skip
        env = {"OMP_NUM_THREADS": "1"}
        with hub_process(config, cwd=root, env=env, timeout=300) as (base, proc):
            kinds = _kinds(base)
            # The limited key's one request a minute, spent.
            _post_any(base, kinds["rate_limited"])
            idle = _idle_rate(proc.pid)
            results["idle_cpu_ms_per_s"] = round(1000 * idle, 2)
            for name in args.kinds:
                spy = None
                if args.profile == name:
                    spy = _profiled(args, proc.pid, args.out / f"edge_cost-{name}.stacks")
                results[name] = asyncio.run(
                    _one_kind(base, proc.pid, name, kinds[name], args, idle)
                )
                if spy is not None:
                    spy.wait(timeout=60)
                print(name, json.dumps(results[name]), flush=True)
                time.sleep(0.5)
    return results


async def _one_kind(
    base: str, pid: int, name: str, kind: Kind, args: argparse.Namespace, idle: float
) -> dict[str, Any]:
    """Measure one kind; for `shed`, with MAX_IN_PROGRESS requests held open meanwhile."""
    host, port = base.removeprefix("http://").split(":")
    held = await hold_open(host, int(port), MAX_IN_PROGRESS) if name == "shed" else []
    try:
        return {
            mode: await measure(base, pid, kind, args.connections, args.seconds, idle, close)
            for mode, close in (("keep_alive", False), ("new_connection", True))
        }
    finally:
        for writer in held:
            writer.close()


def _post_any(base: str, kind: Kind) -> None:
    import httpx

    httpx.post(base + kind.path, json=kind.body,
               headers={"Authorization": f"Bearer {kind.key}"}, timeout=60)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds")
    parser.add_argument("--seconds", type=float, default=4.0, help="per kind")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--profile", choices=KINDS, help="py-spy the hub during this kind")
    parser.add_argument("--py-spy", default="py-spy", help="the py-spy executable")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(args.kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    if args.connections >= MAX_IN_PROGRESS:
        parser.error(f"--connections must be under {MAX_IN_PROGRESS} (the in-progress bound)")
    args.out.mkdir(parents=True, exist_ok=True)
    try:  # the client's own CPU per request is less on uvloop, on the hub's cores
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    load_before = os.getloadavg()
    results = run_kinds(args)
    report = {
        "connections": args.connections,
        "seconds_per_kind": args.seconds,
        **results,
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
    }
    (args.out / "edge_cost.json").write_text(json.dumps(report, indent=2) + "\n")
    wrong = {f"{kind} {mode}": m["wrong_answers"] for kind, v in results.items()
             if isinstance(v, dict) for mode, m in v.items() if m["wrong_answers"]}  # fmt: skip
    print(f"wrote {args.out / 'edge_cost.json'}")
    if wrong:
        sys.exit(f"answers of the wrong kind: {wrong}")


if __name__ == "__main__":
    main()
