"""The measuring side of benchmarks/overload.py: send requests one at a time or all at once,
and summarise what came back (admitted, shed, lost, latency percentiles).

A request's latency runs from the moment its bytes were written to the socket to its last
byte back (the bare client of benchmarks/raw_http.py records it; httpx's is from the call);
the same percentiles from the moment the client began each request are kept too.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks.raw_http import post_json

Request = tuple[str, dict[str, Any]]  # (path, JSON body)


def kind_of(path: str) -> str:
    """The request kind a path serves, for counting: chat, embed or rerank."""
    if "chat" in path:
        return "chat"
    return "rerank" if "rerank" in path else "embed"


async def send(client: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One request, by httpx (`client` an AsyncClient) or the bare client (`client` the URL)."""
    start = time.perf_counter()
    try:
        if isinstance(client, str):
            async with asyncio.timeout(300):
                r: Any = await post_json(client, path, body)
        else:
            r = await client.post(path, json=body)
    except Exception as e:  # a request with no answer is what we count
        lost = time.perf_counter() - start
        return {"status": None, "error": type(e).__name__, "kind": kind_of(path), "s": lost,
                "from_start_s": lost}  # fmt: skip
    end = time.perf_counter()
    # From the moment the request was written (the bare client knows it): the time before is
    # this client's own, its coroutines opening hundreds of connections on the same cores.
    sent = getattr(r, "sent_at", 0.0) or start
    return {
        "status": r.status_code,
        "retry_after": r.headers.get("retry-after"),
        "kind": kind_of(path),
        "message": r.json().get("error", {}).get("message") if r.status_code != 200 else None,
        "s": end - sent,
        "from_start_s": end - start,
    }


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 1)


def summary(
    results: list[dict[str, Any]], wall_s: float, within_s: float | None = None
) -> dict[str, Any]:
    """Counts and percentiles of `results`; with `within_s`, the admitted requests answered
    within it (`within_goal`) and those per second of the run (`goodput_rps`)."""
    ok = [r["s"] for r in results if r["status"] == 200]
    ok_from_start = [r["from_start_s"] for r in results if r["status"] == 200]
    shed = [r for r in results if r["status"] == 503]
    other = [r for r in results if r["status"] not in (200, 503, 404, None)]
    lost = [r for r in results if r["status"] is None]
    kinds = sorted({r["kind"] for r in results})
    by_kind = {
        k: ms(percentile([r["s"] for r in results if r["status"] == 200 and r["kind"] == k], 0.99))
        for k in kinds
    }
    out: dict[str, Any] = {
        "sent": len(results),
        "admitted": len(ok),
        "shed": len(shed),
        "shed_with_retry_after": sum(r["retry_after"] is not None for r in shed),
        "admitted_by_kind": {
            k: sum(r["kind"] == k for r in results if r["status"] == 200) for k in kinds
        },
        "shed_by_kind": {k: sum(r["kind"] == k for r in shed) for k in kinds},
        "p99_ms_by_kind": by_kind,
        "not_found": sum(r["status"] == 404 for r in results),
        "other_status": sorted({r["status"] for r in other}),
        "lost": len(lost),
        "lost_errors": sorted({r["error"] for r in lost}),
        # Every answer, shed and refused ones included: how fast the hub answers at all.
        "answer_p50_ms": ms(percentile([r["s"] for r in results if r["status"]], 0.50)),
        "answer_p99_ms": ms(percentile([r["s"] for r in results if r["status"]], 0.99)),
        "p50_ms": ms(percentile(ok, 0.50)),
        "p90_ms": ms(percentile(ok, 0.90)),
        "p99_ms": ms(percentile(ok, 0.99)),
        # Stalls show as such: admitted requests over 3x the median.
        "over_3x_p50": sum(s > 3 * (percentile(ok, 0.50) or 0) for s in ok),
        "max_ms": ms(max(ok, default=None)),
        # The same from the moment this client began the request (before connecting).
        "p50_from_start_ms": ms(percentile(ok_from_start, 0.50)),
        "p99_from_start_ms": ms(percentile(ok_from_start, 0.99)),
        "wall_s": round(wall_s, 2),
        "requests_per_s": round(len(ok) / wall_s, 1) if wall_s > 0 else None,
        "example_shed_message": shed[0]["message"] if shed else None,
        "example_shed_message_by_kind": {
            k: next((r["message"] for r in shed if r["kind"] == k), None) for k in kinds
        },
    }
    if within_s is not None:
        good = sum(s <= within_s for s in ok)
        out["within_ms"] = ms(within_s)
        out["within_goal"] = good
        out["goodput_rps"] = round(good / wall_s, 1) if wall_s > 0 else None
    return out


async def run(
    base: str,
    requests: list[Request],
    client_kind: str,
    *,
    at_once: bool,
    within_s: float | None = None,
) -> dict[str, Any]:
    """Send `requests` one at a time or all at once, with the `client_kind` of client
    ("raw": benchmarks/raw_http.py, "httpx"); `within_s`: count the admitted requests
    answered within it (`summary`)."""
    import httpx

    n = len(requests)
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as pool:
        client: Any = pool if client_kind == "httpx" else base
        start = time.perf_counter()
        if at_once:
            results = list(await asyncio.gather(*(send(client, p, b) for p, b in requests)))
        else:
            results = [await send(client, p, b) for p, b in requests]
        return summary(results, time.perf_counter() - start, within_s)


def shed_counters(base: str) -> dict[str, float]:
    """The hub's non-zero `hub_requests_shed_total` series."""
    import httpx

    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("hub_requests_shed_total{"):
            labels, value = line.rsplit(" ", 1)
            if float(value):
                out[labels.removeprefix("hub_requests_shed_total")] = float(value)
    return out


def goal_s(unloaded: dict[str, Any]) -> float | None:
    """3x the unloaded p99, in seconds: the latency an admitted request should stay within."""
    return None if unloaded["p99_ms"] is None else 3 * unloaded["p99_ms"] / 1000


def against(unloaded: dict[str, Any], burst: dict[str, Any]) -> dict[str, Any]:
    """The burst's admitted p99 over the unloaded p99, its goodput (admitted requests per
    second answered within 3x the unloaded p99) over the unloaded run's requests per second
    (one at a time), and the goal's three checks."""
    ratio = goodput = None
    if burst["p99_ms"] and unloaded["p99_ms"]:
        ratio = round(burst["p99_ms"] / unloaded["p99_ms"], 2)
    if burst.get("goodput_rps") is not None and unloaded["requests_per_s"]:
        goodput = round(burst["goodput_rps"] / unloaded["requests_per_s"], 2)
    return {
        "admitted_p99_over_unloaded_p99": ratio,
        "goodput_over_unloaded_rate": goodput,
        "goal": {
            "admitted_p99_at_most_3x_unloaded": ratio is not None and ratio <= 3,
            "every_shed_a_503_with_retry_after": burst["shed"] == burst["shed_with_retry_after"],
            "none_lost": burst["lost"] == 0 and not burst["other_status"],
        },
    }
