"""`hub keys`: API keys with their policies (models, limits, priority, expiry).

With `--url` (or `$HUB_URL`) the commands are clients of the running hub's admin API
(`/admin/keys`, an admin key in `--key` / `$HUB_API_KEY` when auth is on); without, they
work on the database of the config file, as a first admin key must be made. Either way a
change reaches every replica within about a second.

    hub keys create team-a --model chat --limit requests_per_minute=60 --priority batch
    hub keys create team-b --limit requests_per_minute=600 \
        --model-limit chat:tokens_per_minute=1000 --model-limit emb:requests_per_minute=6000
    hub keys update team-a --limit tokens_per_day=2000000
    hub keys revoke team-a
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Annotated, Any

import typer

from hub.cli_remote import ConfigOpt, KeyOpt, NoHub, cli_settings, fail, request

keys_app = typer.Typer(
    help="API keys (stored hashed), with models, limits, priority and expiry. With --url "
    "(or $HUB_URL) through the hub's admin API, else on the config's database.",
    no_args_is_help=True,
)

KeysUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--url", envvar="HUB_URL", help="Base URL of a running hub (default: the database)"
    ),
]
ModelsOpt = Annotated[
    list[str] | None,
    typer.Option("--model", "-m", help="A model the key may use (name, name@version or "
                 "name@alias); repeat for more; none: every model"),
]  # fmt: skip
LimitsOpt = Annotated[
    list[str] | None,
    typer.Option("--limit", help="NAME=N with NAME one of requests_per_minute, "
                 "tokens_per_minute, tokens_per_day, max_concurrent; repeat for more"),
]  # fmt: skip
ModelLimitsOpt = Annotated[
    list[str] | None,
    typer.Option("--model-limit", help="MODEL:NAME=N, a limit of the key on one model (by "
                 "registered name; versions and aliases count against it), NAME as for "
                 "--limit; repeat for more"),
]  # fmt: skip
PriorityOpt = Annotated[
    str | None, typer.Option(help="interactive | standard | batch (default standard)")
]
ExpiresOpt = Annotated[
    str | None, typer.Option("--expires-at", help="ISO 8601 time after which the key fails")
]


@keys_app.command("create")
def keys_create(
    name: str,
    role: Annotated[str, typer.Option(help="admin | user")] = "user",
    model: ModelsOpt = None,
    limit: LimitsOpt = None,
    model_limit: ModelLimitsOpt = None,
    priority: PriorityOpt = None,
    expires_at: ExpiresOpt = None,
    url: KeysUrlOpt = None,
    key: KeyOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Create an API key; the key is printed once."""
    body: dict[str, Any] = {"name": name, "role": role, "models": model or None}
    body["limits"] = _limits(limit, model_limit)
    body["priority"] = priority or "standard"
    body["expires_at"] = expires_at
    if url:
        created = _remote("POST", "/admin/keys", url, key, body)
        secret = created["key"]
    else:
        secret, _ = _local("create", config, **body)
    typer.echo(secret)


@keys_app.command("list")
def keys_list(url: KeysUrlOpt = None, key: KeyOpt = None, config: ConfigOpt = None) -> None:
    """List API keys (names, roles, prefixes, policies; never the keys)."""
    listed = _remote("GET", "/admin/keys", url, key) if url else _local("list", config)
    for k in listed:
        typer.echo(_line(k))


@keys_app.command("show")
def keys_show(
    name: str, url: KeysUrlOpt = None, key: KeyOpt = None, config: ConfigOpt = None
) -> None:
    """One API key's record and policy, as JSON."""
    shown = _remote("GET", f"/admin/keys/{name}", url, key) if url else _local("get", config, name)
    typer.echo(json.dumps(shown, indent=2, default=str))


@keys_app.command("update")
def keys_update(
    name: str,
    role: Annotated[str | None, typer.Option(help="admin | user")] = None,
    model: ModelsOpt = None,
    all_models: Annotated[bool, typer.Option(help="Let the key use every model")] = False,
    limit: LimitsOpt = None,
    model_limit: ModelLimitsOpt = None,
    no_limits: Annotated[bool, typer.Option(help="Remove every limit")] = False,
    priority: PriorityOpt = None,
    expires_at: ExpiresOpt = None,
    no_expiry: Annotated[bool, typer.Option(help="The key never expires")] = False,
    url: KeysUrlOpt = None,
    key: KeyOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Change the policy of API key NAME (only what is given changes; --limit and
    --model-limit replace all the key's limits together)."""
    body: dict[str, Any] = {}
    if role is not None:
        body["role"] = role
    if model or all_models:
        body["models"] = None if all_models else model
    if limit or model_limit or no_limits:
        body["limits"] = None if no_limits else _limits(limit, model_limit)
    if priority is not None:
        body["priority"] = priority
    if expires_at is not None or no_expiry:
        body["expires_at"] = None if no_expiry else expires_at
    if not body:
        raise fail(
            "nothing to change: give --model, --limit, --model-limit, --priority, --role or "
            "--expires-at",
            2,
        )
    if url:
        updated = _remote("PATCH", f"/admin/keys/{name}", url, key, body)
    else:
        updated = _local("update", config, name, **body)
    typer.echo(_line(updated))


@keys_app.command("revoke")
def keys_revoke(
    name: str, url: KeysUrlOpt = None, key: KeyOpt = None, config: ConfigOpt = None
) -> None:
    """Revoke the API key NAME: every replica refuses it within about a second."""
    if url:
        _remote("DELETE", f"/admin/keys/{name}", url, key)
    else:
        _local("revoke", config, name)
    typer.echo(f"revoked {name}")


def _limits(values: list[str] | None, per_model: list[str] | None = None) -> dict[str, Any] | None:
    """`--limit NAME=N` and `--model-limit MODEL:NAME=N` options as the limits object."""
    if not values and not per_model:
        return None
    limits: dict[str, Any] = {}
    for value in values or ():
        name, number = _limit(value, value, "--limit", "NAME=N, e.g. requests_per_minute=60")
        limits[name] = number
    expected = "MODEL:NAME=N, e.g. chat:tokens_per_minute=1000"
    for value in per_model or ():
        model, sep, rest = value.partition(":")
        if not sep or not model.strip():
            raise fail(f"--model-limit {value!r}: expected {expected}", 2)
        name, number = _limit(rest, value, "--model-limit", expected)
        limits.setdefault("models", {}).setdefault(model.strip(), {})[name] = number
    return limits


def _limit(text: str, value: str, option: str, expected: str) -> tuple[str, int]:
    """`NAME=N` in `text` (of option value `value`) as (NAME, N)."""
    name, sep, number = text.partition("=")
    if not sep or not number.strip().isdigit():
        raise fail(f"{option} {value!r}: expected {expected}", 2)
    return name.strip(), int(number)


def _remote(method: str, path: str, url: str, key: str | None, body: Any = None) -> Any:
    try:
        return request(method, path, url, key, body=body)
    except NoHub as e:
        raise fail(f"{e}; without --url (and $HUB_URL) keys are managed on the database") from None


def _local(action: str, config: Any, *args: Any, **fields: Any) -> Any:
    """`ApiKeys.<action>` on the config's database, answered as the admin API would."""
    from registry.db import Database, upgrade
    from registry.errors import RegistryError
    from registry.keys import ApiKeys, KeyLimits

    settings = cli_settings(config)
    upgrade(settings.database_url)
    keys = ApiKeys(Database(settings.database_url))
    try:
        if "limits" in fields:
            fields["limits"] = KeyLimits.from_json(fields["limits"])
        if fields.get("expires_at"):
            fields["expires_at"] = dt.datetime.fromisoformat(fields["expires_at"])
        if action == "create":
            secret, view = keys.create(*args, **fields)
            return secret, _record(view)
        if action == "list":
            return [_record(v) for v in keys.list()]
        return _record(getattr(keys, action)(*args, **fields))
    except (ValueError, RegistryError) as e:
        raise fail(str(e)) from None


def _record(view: Any) -> dict[str, Any]:
    """A key's record as the admin API answers it."""
    policy = view.policy
    return {
        "name": view.name,
        "prefix": view.prefix,
        "role": view.role,
        "models": list(policy.models) if policy.models is not None else None,
        "limits": policy.limits.to_json() if policy.limits is not None else None,
        "priority": policy.priority,
        "expires_at": policy.expires_at.isoformat() if policy.expires_at else None,
        "created_at": view.created_at.isoformat(),
        "revoked_at": view.revoked_at.isoformat() if view.revoked_at else None,
    }


def _line(k: dict[str, Any]) -> str:
    """One key on one line: name, role, prefix, state, then its policy."""
    state = f"revoked {k['revoked_at'][:10]}" if k.get("revoked_at") else "active"
    models = ",".join(k["models"]) if k.get("models") else "*"
    limits = dict(k.get("limits") or {})
    per_model = limits.pop("models", None) or {}
    parts = [f"{n}={v}" for n, v in limits.items() if v is not None]
    for model, own in per_model.items():
        parts += [f"{model}:{n}={v}" for n, v in own.items() if v is not None]
    shown = ",".join(parts) or "-"
    expiry = f" expires {k['expires_at']}" if k.get("expires_at") else ""
    return (f"{k['name']:24} {k['role']:6} {k['prefix']}…  {state}  models={models} "
            f"limits={shown} priority={k['priority']}{expiry}")  # fmt: skip
