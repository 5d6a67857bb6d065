"""The `hub` command: serve, migrate, register and inspect models, manage keys and residency.

Registry commands talk to the database and MLflow named by the config file; `hub load`,
`hub unload`, `hub pin`, `hub unpin`, `hub status`, `hub traffic`, `hub canary` and
`hub readout` talk to a running hub over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hub.settings import CONFIG_ENV, HubSettings, SettingsError, load_settings
from hub.traffic import cli as traffic_cli

if TYPE_CHECKING:
    from registry.service import Registry

app = typer.Typer(
    help="Model Hub: serve many models (LLMs, embedders, rerankers) from one memory pool.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Schema migrations of the hub's own tables.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys (stored hashed).", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")
traffic_cli.install(app)  # hub traffic | canary | readout

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help=f"YAML settings file (default: ${CONFIG_ENV})"),
]
UrlOpt = Annotated[str, typer.Option("--url", envvar="HUB_URL", help="Base URL of a running hub")]
KeyOpt = Annotated[
    str | None, typer.Option("--key", envvar="HUB_API_KEY", help="Admin API key, if auth is on")
]


def _settings(config: Path | None, **overrides: Any) -> HubSettings:
    try:
        settings = load_settings(config)
    except SettingsError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None
    updates = {k: v for k, v in overrides.items() if v is not None}
    return settings.model_copy(update=updates) if updates else settings


def _registry(settings: HubSettings) -> Registry:
    """The registry the app would build from `settings` (hub.control.build_registry),
    migrated first."""
    from hub.control import build_registry
    from registry.db import upgrade

    upgrade(settings.database_url)
    return build_registry(settings)


def _fail(message: str, code: int = 1) -> typer.Exit:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(code)


@app.command()
def serve(
    config: ConfigOpt = None,
    host: Annotated[str | None, typer.Option(help="Interface to bind")] = None,
    port: Annotated[int | None, typer.Option(help="Port to bind")] = None,
    log_config: Annotated[Path | None, typer.Option(help="logging dictConfig YAML")] = None,
) -> None:
    """Start the hub: migrate, register configured models, serve HTTP."""
    import uvicorn

    from hub.app import create_app
    from hub.logs import configure_logging

    settings = _settings(config, host=host, port=port)
    configure_logging(settings.log_level, log_config)
    uvicorn.run(
        create_app(settings, announce=True),
        host=settings.host,
        port=settings.port,
        log_config=None,
        # SIGTERM: stop accepting, let requests in flight (streams too) finish, then stop.
        timeout_graceful_shutdown=math.ceil(settings.replica.drain_timeout),
    )


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


@app.command()
def register(
    name: Annotated[str, typer.Option(help="Registered model name")],
    kind: Annotated[str, typer.Option(help="llm | embedder | reranker")],
    source: Annotated[str, typer.Option(help="Local folder (or builtin:<demo model>)")],
    alias: Annotated[list[str] | None, typer.Option(help="Alias to set; repeatable")] = None,
    runtime_config: Annotated[
        str | None, typer.Option("--runtime-config", help="JSON object of runtime settings")
    ] = None,
    description: str = "",
    eval_set: Annotated[
        Path | None, typer.Option(help="JSON file: the version's evaluation set")
    ] = None,
    base: Annotated[
        str | None,
        typer.Option(
            help="For a LoRA adapter folder: the registered llm it runs on, name@version or "
            "name@alias"
        ),
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """Register a new version of a model from SOURCE (a folder, hf://org/name[@rev],
    models:/name/3, models:/name@alias or runs:/<run id>/<path>); a PEFT LoRA adapter
    folder takes --base."""
    from backends.runtime_config import RuntimeConfigError, parse_runtime_config
    from hub.demo import is_builtin, materialise_builtin
    from registry.errors import RegistryError

    settings = _settings(config)
    try:
        extra = json.loads(runtime_config) if runtime_config else {}
    except ValueError as e:
        raise _fail(f"--runtime-config is not JSON: {e}", 2) from None
    if not isinstance(extra, dict):
        raise _fail("--runtime-config must be a JSON object of keys to values", 2)
    try:
        parse_runtime_config(kind, extra)
    except (RuntimeConfigError, ValueError) as e:
        raise _fail(f"--runtime-config: {e}", 2) from None
    if is_builtin(source):
        source = str(materialise_builtin(source, settings.demo_dir))
    evals = None
    if eval_set is not None:
        from hub.errors import HubError
        from hub.validation import parse_eval_set

        try:
            evals = json.loads(eval_set.read_text())
            parse_eval_set(kind, evals)
        except (OSError, ValueError) as e:
            raise _fail(f"--eval-set {eval_set}: {e}", 2) from None
        except HubError as e:
            raise _fail(f"--eval-set {eval_set}: {e.message}", 2) from None
    try:
        view = _registry(settings).register(
            name, kind, source, aliases=alias or [], config=extra, description=description,
            eval_set=evals, actor=_actor(), base=base,
        )  # fmt: skip
    except RegistryError as e:
        raise _fail(str(e)) from None
    typer.echo(json.dumps({"name": view.name, "version": view.version}))


def _actor() -> str:
    return f"cli:{os.environ.get('USER', 'unknown')}"


async def _locally(settings: HubSettings, action: Any) -> Any:
    """Run `action(hub)` against the registry without serving: the gate loads the candidate
    in this process, on the configured devices."""
    from hub.state import Hub
    from registry.db import upgrade

    upgrade(settings.database_url)
    hub = Hub.build(settings)
    try:
        await hub.catalog.refresh()
        return await action(hub)
    finally:
        await hub.manager.close()
        hub.db.dispose()


@app.command()
def promote(
    name: str,
    version: int,
    to: Annotated[str, typer.Option("--to", help="staging | production")],
    reason: Annotated[str, typer.Option(help="Why, for the audit log")] = "",
    url: Annotated[
        str | None, typer.Option(help="Ask this running hub instead of validating locally")
    ] = None,
    key: KeyOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Validate VERSION of NAME (load, smoke test, eval set) and move the alias --to to it."""
    if url:
        path = f"/admin/registry/models/{name}/versions/{version}/promote"
        result = _admin("POST", path, url, key, {"to": to, "reason": reason})
    else:
        from hub.errors import HubError
        from registry.errors import RegistryError

        async def run(hub: Any) -> Any:
            p = await hub.promoter.promote(name, version, to, actor=_actor(), reason=reason)
            return {
                "name": name,
                "alias": to,
                "version": version,
                "from_version": p.event.from_version,
                "validation": p.validation.as_dict(),
            }

        try:
            result = asyncio.run(_locally(_settings(config), run))
        except HubError as e:
            raise _fail(e.message) from None
        except RegistryError as e:
            raise _fail(str(e)) from None
    typer.echo(json.dumps(result, indent=2))


@app.command()
def rollback(
    name: str,
    reason: Annotated[str, typer.Option(help="Why, for the audit log")] = "",
    url: Annotated[str | None, typer.Option(help="Ask this running hub instead")] = None,
    key: KeyOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Move production of NAME back to the version before it."""
    if url:
        path = f"/admin/registry/models/{name}/rollback"
        result = _admin("POST", path, url, key, {"reason": reason})
    else:
        from hub.errors import HubError

        async def run(hub: Any) -> Any:
            e = await hub.promoter.rollback(name, actor=_actor(), reason=reason)
            return {
                "name": name,
                "alias": e.alias,
                "version": e.version,
                "from_version": e.from_version,
            }

        try:
            result = asyncio.run(_locally(_settings(config), run))
        except HubError as e:
            raise _fail(e.message) from None
    typer.echo(json.dumps(result, indent=2))


@app.command("models")
def list_models(config: ConfigOpt = None) -> None:
    """List registered models with their versions and aliases."""
    for m in _registry(_settings(config)).list_models():
        aliases = ", ".join(f"{a}->{v}" for a, v in sorted(m.aliases.items())) or "-"
        typer.echo(f"{m.name:30} {m.kind:9} versions {sorted(m.versions)}  aliases {aliases}")


@app.command("versions")
def list_versions(name: str, config: ConfigOpt = None) -> None:
    """List the versions of model NAME."""
    from registry.errors import RegistryError

    try:
        model = _registry(_settings(config)).get_model(name)
    except RegistryError as e:
        raise _fail(str(e)) from None
    for v in sorted(model.versions):
        view = model.versions[v]
        typer.echo(
            f"v{v:<4} {view.status:11} {view.dtype:9} {view.total_bytes:>12} B  "
            f"aliases [{', '.join(view.aliases)}]  {view.source_uri}"
            + (f"  (adapter on {view.base})" if view.base is not None else "")
        )


@app.command("events")
def list_events(
    name: Annotated[str | None, typer.Argument()] = None, limit: int = 50, config: ConfigOpt = None
) -> None:
    """Print the registry's audit log (newest first)."""
    for e in _registry(_settings(config)).events(name, limit):
        move = f"{e.from_version if e.from_version is not None else '-'} -> {e.version}"
        typer.echo(f"{e.created_at:%Y-%m-%d %H:%M:%S} {e.model} {e.alias} {e.action} {move} "
                   f"by {e.actor}: {e.reason}")  # fmt: skip


@keys_app.command("create")
def keys_create(
    name: str, role: Annotated[str, typer.Option(help="admin | user")] = "user",
    config: ConfigOpt = None,
) -> None:  # fmt: skip
    """Create an API key; the key is printed once."""
    from registry.db import Database, upgrade
    from registry.keys import ApiKeys

    settings = _settings(config)
    upgrade(settings.database_url)
    try:
        key, _ = ApiKeys(Database(settings.database_url)).create(name, role)
    except Exception as e:
        raise _fail(str(e)) from None
    typer.echo(key)


@keys_app.command("list")
def keys_list(config: ConfigOpt = None) -> None:
    """List API keys (names, roles, prefixes; never the keys)."""
    from registry.db import Database
    from registry.keys import ApiKeys

    for k in ApiKeys(Database(_settings(config).database_url)).list():
        state = f"revoked {k.revoked_at:%Y-%m-%d}" if k.revoked_at else "active"
        typer.echo(f"{k.name:24} {k.role:6} {k.prefix}…  {state}")


@keys_app.command("revoke")
def keys_revoke(name: str, config: ConfigOpt = None) -> None:
    """Revoke the API key NAME."""
    from registry.db import Database
    from registry.keys import ApiKeys

    ApiKeys(Database(_settings(config).database_url)).revoke(name)
    typer.echo(f"revoked {name}")


def _admin(
    method: str, path: str, url: str, key: str | None, body: dict[str, Any] | None = None
) -> Any:
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.request(method, url.rstrip("/") + path, headers=headers, json=body, timeout=600)
    except httpx.HTTPError as e:
        raise _fail(f"cannot reach the hub at {url}: {e}") from None
    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code >= 400:
        raise _fail(body.get("error", {}).get("message", r.text))
    return body


@app.command()
def load(
    name: str, version: str, url: UrlOpt = "http://127.0.0.1:8000", key: KeyOpt = None
) -> None:
    """Load VERSION (a number or alias) of NAME on a running hub."""
    typer.echo(
        json.dumps(_admin("POST", f"/admin/models/{name}/versions/{version}/load", url, key))
    )


@app.command()
def unload(
    name: str, version: str, url: UrlOpt = "http://127.0.0.1:8000", key: KeyOpt = None
) -> None:
    """Unload VERSION of NAME on a running hub once its requests finish."""
    typer.echo(
        json.dumps(_admin("POST", f"/admin/models/{name}/versions/{version}/unload", url, key))
    )


@app.command()
def pin(name: str, version: str, url: UrlOpt = "http://127.0.0.1:8000", key: KeyOpt = None) -> None:
    """Load VERSION of NAME if needed and pin it: never evicted until unpinned."""
    typer.echo(json.dumps(_admin("POST", f"/admin/models/{name}/versions/{version}/pin", url, key)))


@app.command()
def unpin(
    name: str, version: str, url: UrlOpt = "http://127.0.0.1:8000", key: KeyOpt = None
) -> None:
    """Unpin VERSION of NAME: evictable again, its keep-alive runs."""
    typer.echo(
        json.dumps(_admin("POST", f"/admin/models/{name}/versions/{version}/unpin", url, key))
    )


@app.command()
def status(url: UrlOpt = "http://127.0.0.1:8000", key: KeyOpt = None) -> None:
    """What a running hub has resident, its devices and its host tier."""
    devices = _admin("GET", "/admin/devices", url, key)
    models = _admin("GET", "/admin/models", url, key)
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
