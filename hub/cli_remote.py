"""Which hub a `hub` command talks to: the running one, unless asked otherwise.

Registry commands (`hub models`, `versions`, `events`, `register`, `promote`, `rollback`)
ask the hub at `--url` (default: `$HUB_URL`, else the configured `host`/`port`), so they see
what it serves and cost no MLflow import, migration or model load in the CLI's process; with
`--local`, or when nothing answers at that address (said on stderr), they work on the
registry directly, as the hub would. Residency commands (`hub load`, `pin`, ...) have no
local mode: they are about a running hub.

Only a refused or unresolvable connection counts as "no hub": a hub that answers with an
error, or is too slow, is reported as such, never retried locally (a promotion may already
have happened there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from hub.settings import CONFIG_ENV, HubSettings, SettingsError, load_settings

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help=f"YAML settings file (default: ${CONFIG_ENV})"),
]
KeyOpt = Annotated[
    str | None, typer.Option("--key", envvar="HUB_API_KEY", help="Admin API key, if auth is on")
]


def cli_settings(config: Path | None, **overrides: Any) -> HubSettings:
    """The settings of `config` (else $HUB_CONFIG, else defaults) with `overrides`; exits 2,
    with the message, when they are invalid."""
    try:
        settings = load_settings(config)
    except SettingsError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None
    updates = {k: v for k, v in overrides.items() if v is not None}
    return settings.model_copy(update=updates) if updates else settings


UrlOpt = Annotated[
    str | None,
    typer.Option(
        "--url",
        envvar="HUB_URL",
        help="Base URL of a running hub (default: the configured host and port)",
    ),
]
LocalOpt = Annotated[
    bool,
    typer.Option(
        "--local",
        help="Work on the registry from this process (database and MLflow of the config) "
        "instead of asking the running hub",
    ),
]
# Reads answer within seconds; a promotion runs the validation gate (a model load).
READ_TIMEOUT = 30.0
WRITE_TIMEOUT = 600.0


class NoHub(Exception):
    """Nothing accepts connections at the hub's address."""


def configured_url(settings: HubSettings) -> str:
    """The address the configured hub listens on, as a client reaches it."""
    host = settings.host if settings.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return f"http://{host}:{settings.port}"


def fail(message: str, code: int = 1) -> typer.Exit:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(code)


def request(
    method: str,
    path: str,
    url: str,
    key: str | None,
    body: dict[str, Any] | None = None,
    params: dict[str, Any] | None = None,
    timeout: float = READ_TIMEOUT,
) -> Any:
    """The hub's JSON answer; NoHub when nothing listens at `url`, typer.Exit (after the
    hub's error message on stderr) for an error answer or a hub that cannot be read."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.request(
            method, url.rstrip("/") + path, headers=headers, json=body, params=params,
            timeout=timeout,
        )  # fmt: skip
    except httpx.ConnectError as e:
        raise NoHub(f"no hub answers at {url} ({e})") from e
    except httpx.HTTPError as e:
        raise fail(f"the hub at {url} did not answer: {type(e).__name__} {e}") from None
    answer = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code >= 400:
        error = answer.get("error", {}) if isinstance(answer, dict) else {}
        raise fail(f"{r.status_code}: {error.get('message') or r.text[:500]}")
    return answer


def ask_hub(
    settings: HubSettings,
    url: str | None,
    local: bool,
    key: str | None,
    method: str,
    path: str,
    **kwargs: Any,
) -> Any | None:
    """The running hub's answer to `method path`; None when the command is to run locally:
    `--local`, or no hub answers at the address (said on stderr)."""
    if local:
        return None
    target = url or configured_url(settings)
    try:
        return request(method, path, target, key, **kwargs)
    except NoHub as e:
        typer.echo(f"{e}; working on the registry locally (--local to skip asking)", err=True)
        return None


def absolute_source(source: str) -> str:
    """A local folder as an absolute path, for a hub whose working directory differs; any
    other source (hf://, models:/, runs:/) as given."""
    path = Path(source).expanduser()
    return str(path.resolve()) if "://" not in source and path.exists() else source
