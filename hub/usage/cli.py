"""`hub usage`: metered usage from a running hub's `GET /admin/usage` (`--url`, default
`$HUB_URL`, else the configured host and port; `--key`, an admin key), as `hub readout` asks
it. A table by default, the hub's JSON with `--json`.

    hub usage                                   # per key, model and version, all time
    hub usage --key-name team-a --since 2026-11-01 --group-by model,hour
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from hub.cli_remote import (
    ConfigOpt,
    KeyOpt,
    NoHub,
    UrlOpt,
    cli_settings,
    configured_url,
    fail,
    request,
)

_COLUMNS = ("requests", "errors", "prompt_tokens", "completion_tokens", "embedded_inputs",
            "rerank_documents")  # fmt: skip


def usage(
    key_name: Annotated[
        str | None, typer.Option("--key-name", help="only this caller (API key name)")
    ] = None,
    model: Annotated[str | None, typer.Option(help="only this model")] = None,
    since: Annotated[str | None, typer.Option(help="ISO 8601 time or date, inclusive")] = None,
    until: Annotated[str | None, typer.Option(help="ISO 8601 time or date, exclusive")] = None,
    group_by: Annotated[
        str, typer.Option("--group-by", help="comma list of key, model, version, hour")
    ] = "key,model,version",
    as_json: Annotated[bool, typer.Option("--json", help="print the hub's JSON answer")] = False,
    url: UrlOpt = None,
    key: KeyOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Metered usage summed over every replica: requests, errors and tokens per key, model,
    version or hour."""
    params = {"key": key_name, "model": model, "since": since, "until": until,
              "group_by": group_by}  # fmt: skip
    base = url or configured_url(cli_settings(config))
    try:
        rows = request("GET", "/admin/usage", base, key,
                       params={k: v for k, v in params.items() if v is not None})  # fmt: skip
    except NoHub as e:
        raise fail(str(e)) from None
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    typer.echo(table(rows, [d.strip() for d in group_by.split(",") if d.strip()]))


def table(rows: list[dict[str, Any]], dimensions: list[str]) -> str:
    """`rows` as aligned text: the dimensions grouped by, then the counts."""
    header = [*dimensions, *_COLUMNS]
    cells = [[_cell(row.get(c)) for c in header] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    if not rows:
        lines.append("(no usage)")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)
