"""`hub traffic`, `hub canary` and `hub readout`: versioned routing on a running hub, over
HTTP (`--url`, default `$HUB_URL`, else the host and port `$HUB_CONFIG` configures; `--key`),
as `hub load` does. Each command prints the hub's JSON answer.

    hub traffic set emb --split 1=90 --split 2=10 [--shadow 3=20] [--fault 2=50:200ms]
    hub traffic get emb ; hub traffic clear emb
    hub canary start emb --version 2 --steps 5,25,50,100 --interval 60s \\
        --max-error-rate 0.05 --max-latency-ratio 1.5 --min-requests 50
    hub canary status emb ; hub canary abort emb --reason "..."
    hub readout emb
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

import typer

from hub.cli_remote import (
    WRITE_TIMEOUT,
    KeyOpt,
    NoHub,
    UrlOpt,
    cli_settings,
    configured_url,
    fail,
    request,
)

traffic_app = typer.Typer(
    help="Traffic policy of a model on a running hub: split, shadow, faults.",
    no_args_is_help=True,
)
canary_app = typer.Typer(
    help="Automated canaries on a running hub: start, status, abort.", no_args_is_help=True
)


# [model@]version=number, e.g. "2=10", "other@1=50"; faults add ":delay" ("2=50:200ms").
_ENTRY_RE = re.compile(
    r"^(?:(?P<model>[A-Za-z0-9][A-Za-z0-9._-]*)@)?(?P<version>\d+)=(?P<rest>.+)$"
)


def _call(method: str, path: str, url: str | None, key: str | None, body: Any = None) -> Any:
    base = url or configured_url(cli_settings(None))
    try:
        return request(method, path, base, key, body, timeout=WRITE_TIMEOUT)
    except NoHub as e:
        raise fail(str(e)) from None


def _print(doc: Any) -> None:
    typer.echo(json.dumps(doc, indent=2))


def _entry(text: str, option: str) -> tuple[str | None, int, str]:
    match = _ENTRY_RE.match(text.strip())
    if match is None:
        raise fail(f"{option} {text!r}: expected [MODEL@]VERSION=NUMBER, e.g. 2=10", 2)
    return match["model"], int(match["version"]), match["rest"]


def _number(text: str, option: str, entry: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise fail(f"{option} {entry!r}: {text!r} is not a number", 2) from None


def _split(text: str) -> dict[str, Any]:
    model, version, weight = _entry(text, "--split")
    return {"version": version, "weight": _number(weight, "--split", text), "model": model}


def _shadow(text: str) -> dict[str, Any]:
    model, version, percent = _entry(text, "--shadow")
    return {"version": version, "percent": _number(percent, "--shadow", text), "model": model}


def _fault(text: str) -> dict[str, Any]:
    from hub.units import parse_duration

    model, version, rest = _entry(text, "--fault")
    percent, _, delay = rest.partition(":")
    try:
        delay_ms = parse_duration(delay) * 1000 if delay else 0.0
    except ValueError as e:
        raise fail(f"--fault {text!r}: {e}", 2) from None
    return {
        "version": version,
        "error_percent": _number(percent, "--fault", text),
        "delay_ms": delay_ms,
        "model": model,
    }


@traffic_app.command("get")
def traffic_get(name: str, url: UrlOpt = None, key: KeyOpt = None) -> None:
    """The effective policy of NAME: its split (or the default), shadow, faults, canary."""
    _print(_call("GET", f"/admin/traffic/{name}", url, key))


@traffic_app.command("set")
def traffic_set(
    name: str,
    split: Annotated[
        list[str], typer.Option(help="[MODEL@]VERSION=WEIGHT; repeat; weights sum to 100")
    ],
    shadow: Annotated[
        str | None, typer.Option(help="[MODEL@]VERSION=PERCENT of requests to mirror")
    ] = None,
    fault: Annotated[
        list[str] | None,
        typer.Option(help="[MODEL@]VERSION=ERROR_PERCENT[:DELAY], e.g. 2=50 or 2=0:200ms"),
    ] = None,
    url: UrlOpt = None,
    key: KeyOpt = None,
) -> None:
    """Replace the traffic policy of NAME (split, shadow and faults together)."""
    body = {
        "splits": [_split(s) for s in split],
        "shadow": _shadow(shadow) if shadow else None,
        "faults": [_fault(f) for f in fault or []],
    }
    _print(_call("PUT", f"/admin/traffic/{name}", url, key, body))


@traffic_app.command("clear")
def traffic_clear(name: str, url: UrlOpt = None, key: KeyOpt = None) -> None:
    """Back to the default: everything to production (else the latest version)."""
    _print(_call("DELETE", f"/admin/traffic/{name}", url, key))


@canary_app.command("start")
def canary_start(
    name: str,
    version: Annotated[int, typer.Option(help="The version to canary")],
    steps: Annotated[str, typer.Option(help="Canary share per step, percent")] = "5,25,50,100",
    interval: Annotated[str, typer.Option(help="Least time per step (30s, 5m)")] = "60s",
    max_error_rate: Annotated[float, typer.Option(help="Error-rate limit, a fraction")] = 0.05,
    max_latency_ratio: Annotated[
        float, typer.Option(help="Limit of canary p95 / baseline p95")
    ] = 1.5,
    min_requests: Annotated[int, typer.Option(help="Requests per version per step")] = 50,
    url: UrlOpt = None,
    key: KeyOpt = None,
) -> None:
    """Start an automated canary of VERSION against production; the last step promotes."""
    try:
        weights = [float(s) for s in steps.split(",") if s.strip()]
    except ValueError:
        raise fail(f"--steps {steps!r}: expected numbers separated by commas", 2) from None
    body = {
        "version": version,
        "steps": weights,
        "interval": interval,
        "max_error_rate": max_error_rate,
        "max_latency_ratio": max_latency_ratio,
        "min_requests": min_requests,
    }
    _print(_call("POST", f"/admin/traffic/{name}/canary", url, key, body))


@canary_app.command("status")
def canary_status(name: str, url: UrlOpt = None, key: KeyOpt = None) -> None:
    """The running canary of NAME (else its last one): step, weight, state, reason."""
    _print(_call("GET", f"/admin/traffic/{name}/canary", url, key))


@canary_app.command("abort")
def canary_abort(
    name: str,
    reason: Annotated[str, typer.Option(help="Why, recorded with the canary")] = "",
    url: UrlOpt = None,
    key: KeyOpt = None,
) -> None:
    """Stop the running canary of NAME; all traffic back to the baseline."""
    _print(_call("POST", f"/admin/traffic/{name}/canary/abort", url, key, {"reason": reason}))


def readout(name: str, url: UrlOpt = None, key: KeyOpt = None) -> None:
    """Per-version requests, errors, latency, tokens/s and tests for NAME (every replica's)."""
    _print(_call("GET", f"/admin/traffic/{name}/readout", url, key))


def install(app: typer.Typer) -> None:
    """Add `traffic`, `canary` and `readout` to the `hub` command."""
    app.add_typer(traffic_app, name="traffic")
    app.add_typer(canary_app, name="canary")
    app.command("readout")(readout)
