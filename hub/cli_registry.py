"""`hub register`, `promote`, `rollback`, `models`, `versions` and `events`: the registry,
through the running hub by default (hub.cli_remote), or from this process with `--local` or
when no hub answers: then the database is migrated and MLflow reached from here, and a
promotion's validation gate loads the model here."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hub.cli_remote import (
    WRITE_TIMEOUT,
    ConfigOpt,
    KeyOpt,
    LocalOpt,
    absolute_source,
    ask_hub,
)
from hub.cli_remote import UrlOpt as HubUrlOpt
from hub.cli_remote import cli_settings as _settings
from hub.cli_remote import fail as _fail
from hub.settings import HubSettings

if TYPE_CHECKING:
    from registry.service import Registry


def install(app: typer.Typer) -> None:
    """Add the registry commands to the `hub` command."""
    app.command()(register)
    app.command()(promote)
    app.command()(rollback)
    app.command("models")(list_models)
    app.command("versions")(list_versions)
    app.command("events")(list_events)


def _registry(settings: HubSettings) -> Registry:
    """The registry the app would build from `settings` (hub.control.build_registry),
    migrated first."""
    from hub.control import build_registry
    from registry.db import upgrade

    upgrade(settings.database_url)
    return build_registry(settings)


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
    url: HubUrlOpt = None,
    local: LocalOpt = False,
    key: KeyOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Register a new version of a model from SOURCE (a folder, hf://org/name[@rev],
    models:/name/3, models:/name@alias or runs:/<run id>/<path>); a PEFT LoRA adapter
    folder takes --base."""
    from hub.demo import is_builtin, materialise_builtin

    settings = _settings(config)
    try:
        extra = json.loads(runtime_config) if runtime_config else {}
    except ValueError as e:
        raise _fail(f"--runtime-config is not JSON: {e}", 2) from None
    if not isinstance(extra, dict):
        raise _fail("--runtime-config must be a JSON object of keys to values", 2)
    if is_builtin(source):
        source = str(materialise_builtin(source, settings.demo_dir))
    try:
        evals = json.loads(eval_set.read_text()) if eval_set is not None else None
    except (OSError, ValueError) as e:
        raise _fail(f"--eval-set {eval_set}: {e}", 2) from None
    body = {"name": name, "kind": kind, "source": absolute_source(source),
            "aliases": alias or [], "config": extra, "description": description,
            "eval_set": evals, "base": base}  # fmt: skip
    # The hub checks the runtime config and the evaluation set as the local path does.
    created = ask_hub(settings, url, local, key, "POST", "/admin/registry/models", body=body,
                      timeout=WRITE_TIMEOUT)  # fmt: skip
    if created is None:
        created = _register_locally(settings, body, eval_set)
    typer.echo(json.dumps({"name": created["name"], "version": created["version"]}))


def _register_locally(
    settings: HubSettings, body: dict[str, Any], eval_set: Path | None
) -> dict[str, Any]:
    from backends.runtime_config import RuntimeConfigError, parse_runtime_config
    from registry.errors import RegistryError

    kind, extra, evals = body["kind"], body["config"], body["eval_set"]
    try:
        parse_runtime_config(kind, extra)
    except (RuntimeConfigError, ValueError) as e:
        raise _fail(f"--runtime-config: {e}", 2) from None
    if evals is not None:
        from hub.errors import HubError
        from hub.validation import parse_eval_set

        try:
            parse_eval_set(kind, evals)
        except ValueError as e:
            raise _fail(f"--eval-set {eval_set}: {e}", 2) from None
        except HubError as e:
            raise _fail(f"--eval-set {eval_set}: {e.message}", 2) from None
    try:
        view = _registry(settings).register(
            body["name"], kind, body["source"], aliases=body["aliases"], config=extra,
            description=body["description"], eval_set=evals, actor=_actor(),
            base=body["base"],
        )  # fmt: skip
    except RegistryError as e:
        raise _fail(str(e)) from None
    return {"name": view.name, "version": view.version}


def _actor() -> str:
    return f"cli:{os.environ.get('USER', 'unknown')}"


def _locally(settings: HubSettings, action: Any) -> Any:
    """Run `action(hub)` against the registry without serving: the gate loads the candidate
    in this process, on the configured devices. A refusal exits 1 with its message."""
    from hub.errors import HubError
    from hub.state import Hub
    from registry.db import upgrade
    from registry.errors import RegistryError

    async def run() -> Any:
        upgrade(settings.database_url)
        hub = Hub.build(settings)
        try:
            await hub.catalog.refresh()
            return await action(hub)
        finally:
            await hub.manager.close()
            hub.db.dispose()

    try:
        return asyncio.run(run())
    except HubError as e:
        raise _fail(e.message) from None
    except RegistryError as e:
        raise _fail(str(e)) from None


def promote(
    name: str,
    version: int,
    to: Annotated[str, typer.Option("--to", help="staging | production")],
    reason: Annotated[str, typer.Option(help="Why, for the audit log")] = "",
    url: HubUrlOpt = None,
    local: LocalOpt = False,
    key: KeyOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Validate VERSION of NAME (load, smoke test, eval set) and move the alias --to to it;
    the running hub validates it, or this process with --local (it loads the model)."""
    settings = _settings(config)
    path = f"/admin/registry/models/{name}/versions/{version}/promote"
    body = {"to": to, "reason": reason}
    result = ask_hub(settings, url, local, key, "POST", path, body=body, timeout=WRITE_TIMEOUT)
    if result is None:

        async def run(hub: Any) -> Any:
            p = await hub.promoter.promote(name, version, to, actor=_actor(), reason=reason)
            return {
                "name": name,
                "alias": to,
                "version": version,
                "from_version": p.event.from_version,
                "validation": p.validation.as_dict(),
            }

        result = _locally(settings, run)
    typer.echo(json.dumps(result, indent=2))


def rollback(
    name: str,
    reason: Annotated[str, typer.Option(help="Why, for the audit log")] = "",
    url: HubUrlOpt = None,
    local: LocalOpt = False,
    key: KeyOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Move production of NAME back to the version before it."""
    settings = _settings(config)
    path = f"/admin/registry/models/{name}/rollback"
    body = {"reason": reason}
    result = ask_hub(settings, url, local, key, "POST", path, body=body, timeout=WRITE_TIMEOUT)
    if result is None:

        async def run(hub: Any) -> Any:
            e = await hub.promoter.rollback(name, actor=_actor(), reason=reason)
            return {
                "name": name,
                "alias": e.alias,
                "version": e.version,
                "from_version": e.from_version,
            }

        result = _locally(settings, run)
    typer.echo(json.dumps(result, indent=2))


def list_models(
    url: HubUrlOpt = None, local: LocalOpt = False, key: KeyOpt = None, config: ConfigOpt = None
) -> None:
    """List registered models with their versions and aliases."""
    settings = _settings(config)
    models = ask_hub(settings, url, local, key, "GET", "/admin/registry/models")
    if models is None:
        models = [
            {"name": m.name, "kind": m.kind, "versions": sorted(m.versions), "aliases": m.aliases}
            for m in _registry(settings).list_models()
        ]
    for m in models:
        aliases = ", ".join(f"{a}->{v}" for a, v in sorted(m["aliases"].items())) or "-"
        typer.echo(f"{m['name']:30} {m['kind']:9} versions {m['versions']}  aliases {aliases}")


def list_versions(
    name: str,
    url: HubUrlOpt = None,
    local: LocalOpt = False,
    key: KeyOpt = None,
    config: ConfigOpt = None,
) -> None:
    """List the versions of model NAME."""
    settings = _settings(config)
    path = f"/admin/registry/models/{name}/versions"
    versions = ask_hub(settings, url, local, key, "GET", path)
    if versions is None:
        from registry.errors import RegistryError

        try:
            model = _registry(settings).get_model(name)
        except RegistryError as e:
            raise _fail(str(e)) from None
        versions = [model.versions[v].__dict__ for v in sorted(model.versions)]
    for v in versions:
        typer.echo(
            f"v{v['version']:<4} {v['status']:11} {v['dtype']:9} {v['total_bytes']:>12} B  "
            f"aliases [{', '.join(v['aliases'])}]  {v['source_uri']}"
            + (f"  (adapter on {v['base']})" if v.get("base") is not None else "")
        )


def list_events(
    name: Annotated[str | None, typer.Argument()] = None,
    limit: int = 50,
    url: HubUrlOpt = None,
    local: LocalOpt = False,
    key: KeyOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Print the registry's audit log (newest first)."""
    settings = _settings(config)
    params = {"limit": limit, **({"model": name} if name else {})}
    events = ask_hub(settings, url, local, key, "GET", "/admin/registry/events", params=params)
    if events is None:
        events = [
            {**e.__dict__, "created_at": e.created_at.isoformat()}
            for e in _registry(settings).events(name, limit)
        ]
    for e in events:
        when = e["created_at"][:19].replace("T", " ")
        move = f"{e['from_version'] if e['from_version'] is not None else '-'} -> {e['version']}"
        typer.echo(f"{when} {e['model']} {e['alias']} {e['action']} {move} "
                   f"by {e['actor']}: {e['reason']}")  # fmt: skip
