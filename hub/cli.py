"""The `hub` command: serve, migrate, register and inspect models, manage keys and residency.

Registry commands (`models`, `versions`, `events`, `register`, `promote`, `rollback`) ask the
running hub at `--url` (default: `$HUB_URL`, else the configured host and port) and work on
the database and MLflow of the config file themselves only with `--local` or when no hub
answers (hub.cli_remote). `hub load`, `unload`, `pin`, `unpin`, `status`, `traffic`,
`canary`, `readout` and `usage` talk to a running hub only; `db` works on the database, and
`keys` too unless given `--url` (hub.cli_keys).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer

from hub import cli_registry
from hub.cli_keys import keys_app
from hub.cli_remote import WRITE_TIMEOUT, ConfigOpt, KeyOpt, NoHub, configured_url
from hub.cli_remote import UrlOpt as HubUrlOpt
from hub.cli_remote import cli_settings as _settings
from hub.cli_remote import fail as _fail
from hub.cli_remote import request as _request
from hub.traffic import cli as traffic_cli
from hub.usage import cli as usage_cli

app = typer.Typer(
    help="Model Hub: serve many models (LLMs, embedders, rerankers) from one memory pool.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Schema migrations of the hub's own tables.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")


@app.command()
def serve(
    config: ConfigOpt = None,
    host: Annotated[str | None, typer.Option(help="Interface to bind")] = None,
    port: Annotated[int | None, typer.Option(help="Port to bind")] = None,
    log_config: Annotated[Path | None, typer.Option(help="logging dictConfig YAML")] = None,
) -> None:
    """Start the hub: migrate, register configured models, serve HTTP."""
    import uvicorn

    from backends.encoders import forward_process
    from backends.threads import only_compute_threads
    from hub.api.header_limits import MAX_HEADER_BYTES
    from hub.app import create_app
    from hub.logs import configure_logging

    settings = _settings(config, host=host, port=port)
    configure_logging(settings.log_level, log_config)
    # Before anything loads: only the compute threads (LLM engines, encoder workers) start
    # OpenMP teams, so theirs keep spinning between regions (backends/threads.py).
    only_compute_threads()
    # CPU encoders run their forward passes in worker processes, off this one's interpreter
    # lock, unless the settings or their runtime config say otherwise.
    forward_process.use_by_default(settings.encoder_worker_processes)
    uvicorn.run(
        create_app(settings, announce=True, freeze_gc=True),
        host=settings.host,
        port=settings.port,
        log_config=None,
        # SIGTERM: stop accepting, let requests in flight (streams too) finish, then stop.
        timeout_graceful_shutdown=math.ceil(settings.replica.drain_timeout),
        # h11 buffers at most this much of a request head; httptools has no such bound, and
        # the ingress refuses more with 431 (hub.api.header_limits) whichever parser runs.
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )


cli_registry.install(app)  # hub register | promote | rollback | models | versions | events
traffic_cli.install(app)  # hub traffic | canary | readout
app.command("usage")(usage_cli.usage)  # hub usage


@db_app.command("upgrade")
def db_upgrade(
    config: ConfigOpt = None, revision: Annotated[str, typer.Argument()] = "head"
) -> None:
    """Migrate the hub's tables to REVISION (default: newest)."""
    from registry.db import current_revision, upgrade

    settings = _settings(config)
    upgrade(settings.database_url, revision)
    typer.echo(f"database at revision {current_revision(settings.database_url)}")


@db_app.command("downgrade")
def db_downgrade(revision: str, config: ConfigOpt = None) -> None:
    """Migrate the hub's tables down to REVISION ('base' drops them all)."""
    from registry.db import current_revision, downgrade

    settings = _settings(config)
    downgrade(settings.database_url, revision)
    typer.echo(f"database at revision {current_revision(settings.database_url)}")


@db_app.command("current")
def db_current(config: ConfigOpt = None) -> None:
    """Print the schema revision of the hub's tables."""
    from registry.db import current_revision

    typer.echo(current_revision(_settings(config).database_url) or "base (empty)")


def _hub(url: str | None, config: Path | None) -> str:
    """`--url`, else the configured hub's address."""
    return url or configured_url(_settings(config))


def _residency(action: str, name: str, version: str, url: str, key: str | None) -> None:
    path = f"/admin/models/{name}/versions/{version}/{action}"
    try:
        typer.echo(json.dumps(_request("POST", path, url, key, timeout=WRITE_TIMEOUT)))
    except NoHub as e:
        raise _fail(str(e)) from None


@app.command()
def load(
    name: str, version: str, url: HubUrlOpt = None, key: KeyOpt = None, config: ConfigOpt = None
) -> None:
    """Load VERSION (a number or alias) of NAME on a running hub."""
    _residency("load", name, version, _hub(url, config), key)


@app.command()
def unload(
    name: str, version: str, url: HubUrlOpt = None, key: KeyOpt = None, config: ConfigOpt = None
) -> None:
    """Unload VERSION of NAME on a running hub once its requests finish."""
    _residency("unload", name, version, _hub(url, config), key)


@app.command()
def pin(
    name: str, version: str, url: HubUrlOpt = None, key: KeyOpt = None, config: ConfigOpt = None
) -> None:
    """Load VERSION of NAME if needed and pin it: never evicted until unpinned."""
    _residency("pin", name, version, _hub(url, config), key)


@app.command()
def unpin(
    name: str, version: str, url: HubUrlOpt = None, key: KeyOpt = None, config: ConfigOpt = None
) -> None:
    """Unpin VERSION of NAME: evictable again, its keep-alive runs."""
    _residency("unpin", name, version, _hub(url, config), key)


@app.command()
def status(url: HubUrlOpt = None, key: KeyOpt = None, config: ConfigOpt = None) -> None:
    """What a running hub has resident, its devices and its host tier."""
    base = _hub(url, config)
    try:
        devices = _request("GET", "/admin/devices", base, key)
        models = _request("GET", "/admin/models", base, key)
    except NoHub as e:
        raise _fail(str(e)) from None
    typer.echo(
        json.dumps(
            {"devices": devices["devices"], "host_tier": devices["host_tier"], "models": models},
            indent=2,
        )
    )


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
