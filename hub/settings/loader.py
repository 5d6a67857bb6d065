"""`HubSettings`, the whole settings file, and `load_settings`, its one reader: the YAML
file's values with `HUB_` environment variables overriding single keys, and one line per
problem naming the key and where it came from when they cannot be used."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator
from pydantic import field_validator as validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from hub.settings.replica import ReplicaSettings
from hub.settings.sections import (
    AuthSettings,
    ByteSize,
    DeviceSettings,
    EngineSettings,
    ManagerSettings,
    ModelSpec,
    RegistrySettings,
    Seconds,
    StructuredOutputSettings,
    TrafficSettings,
    UsageSettings,
)

ENV_PREFIX = "HUB_"
CONFIG_ENV = "HUB_CONFIG"
# Variables the `hub` command reads as a client of a running hub (`--url`, `--key`); they
# share the prefix but are no settings of the server, so the loader neither reads nor
# refuses them. Any other HUB_ variable must name a setting.
CLIENT_ENV = frozenset({"HUB_URL", "HUB_API_KEY"})


class SettingsError(Exception):
    """Settings that cannot be used; the message names every offending key."""


class HubSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    database_url: str = "sqlite:///.hub/hub.db"
    mlflow_tracking_uri: str = "sqlite:///.hub/mlflow.db"
    # Where embedded MLflow stores artifacts; default: `mlartifacts/` beside its database.
    mlflow_artifact_location: str | None = None
    cache_dir: Path = Path(".hub/cache")
    devices: list[DeviceSettings] = Field(
        default_factory=lambda: [DeviceSettings(name="cpu", memory_budget=4 * 2**30)]
    )
    host_cache_budget: ByteSize = 8 * 2**30
    auth: AuthSettings = AuthSettings()
    models: list[ModelSpec] = Field(default_factory=list)
    manager: ManagerSettings = ManagerSettings()
    registry: RegistrySettings = RegistrySettings()
    traffic: TrafficSettings = TrafficSettings()
    engine: EngineSettings = Field(default_factory=EngineSettings)
    structured_outputs: StructuredOutputSettings = StructuredOutputSettings()
    replica: ReplicaSettings = ReplicaSettings()
    usage: UsageSettings = UsageSettings()
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Largest request body accepted; a larger one is answered 413 before it is read.
    max_request_body_bytes: Annotated[ByteSize, Field(gt=0)] = 8 * 2**20
    # Overload at the HTTP edge (hub/api/edge.py): a new request gets 503 + Retry-After
    # before it is read when this many are in progress in the process (streams until they
    # end), or when the event loop has been busy without a break for longer; 0: no bound.
    # The lag bound is off by default: a one-off stall (a slow first import, a huge body
    # parsed) would refuse the requests behind it; hubs that take bursts set 250ms-1s.
    max_requests_in_progress: int = Field(default=256, ge=0)
    max_event_loop_lag: Seconds = Field(default=0.0, ge=0)
    # Admission by the work on a model's device, for every kind: a request estimated to wait
    # longer than this behind the work queued and running on its device (every model there
    # counted) gets 503 + Retry-After, and the edge refuses that model's next requests at
    # once while the estimate stays over it (hub/saturation.py). The `max_queue_time_ms` of
    # each version that leaves the key out of its runtime config; None: no bound. Off by
    # default: the right bound depends on the device and on how long answers are.
    max_queue_time_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    # Under `hub serve`, CPU encoders whose runtime config leaves `forward_process` unset run
    # their forward passes in worker processes (backends/encoders/forward_process.py); false
    # keeps them in the hub's process (no fork server: a faster start, and cheaper loads).
    encoder_worker_processes: bool = True
    # Safe loading: refuse pickle checkpoints and remote code unless explicitly allowed.
    allow_pickle: bool = False
    trust_remote_code: bool = False
    # Where builtin:<name> demo models are built.
    demo_dir: Path = Path(".hub/demo")

    @model_validator(mode="after")
    def _model_devices_exist(self) -> HubSettings:
        names = {d.name for d in self.devices}
        for i, spec in enumerate(self.models):
            if spec.device is not None and spec.device not in names:
                raise ValueError(
                    f"models.{i} ({spec.name}) asks for device {spec.device!r}, which is not in "
                    f"devices ({', '.join(sorted(names))})"
                )
        return self

    @validator("devices")
    @classmethod
    def _unique_devices(cls, v: list[DeviceSettings]) -> list[DeviceSettings]:
        names = [d.name for d in v]
        if len(set(names)) != len(names):
            raise ValueError(f"devices are listed twice: {names}")
        if not v:
            raise ValueError("at least one device is required")
        return v

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file's values arrive as init kwargs; HUB_ variables override single keys of it.
        return env_settings, init_settings


def _env_keys(environ: dict[str, str]) -> dict[str, str]:
    """{top-level settings key: environment variable} for every HUB_ variable meant for the
    server (not $HUB_CONFIG, not the client's CLIENT_ENV)."""
    out = {}
    for var in environ:
        if var.startswith(ENV_PREFIX) and var != CONFIG_ENV and var not in CLIENT_ENV:
            out[var[len(ENV_PREFIX) :].lower().split("__", 1)[0]] = var
    return out


def _unknown_env(var: str, known: set[str]) -> str:
    """One line for an unknown HUB_ variable, with the closest setting or client variable."""
    names = {f"{ENV_PREFIX}{key.upper()}" for key in known} | CLIENT_ENV | {CONFIG_ENV}
    head = var.split("__", 1)[0]
    close = difflib.get_close_matches(head, sorted(names), n=1, cutoff=0.75)
    return f"{var} (did you mean {close[0]}?)" if close else var


def load_settings(path: str | Path | None = None) -> HubSettings:
    """Settings from `path` (or $HUB_CONFIG, or defaults) with HUB_ overrides applied."""
    path = path or os.environ.get(CONFIG_ENV)
    where = str(path) if path else "defaults"
    data: dict[str, Any] = {}
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise SettingsError(f"{path}: cannot read the config file: {e.strerror}") from e
        except yaml.YAMLError as e:
            raise SettingsError(f"{path}: not valid YAML: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise SettingsError(f"{path}: the top level must be a mapping of keys to values")
        data = loaded or {}
    env_keys = _env_keys(dict(os.environ))
    known = set(HubSettings.model_fields)
    unknown_env = sorted(var for key, var in env_keys.items() if key not in known)
    if unknown_env:
        raise SettingsError(
            f"environment: unknown setting {', '.join(_unknown_env(v, known) for v in unknown_env)}"
            f" (known keys: {', '.join(sorted(known))}; the client's own variables: "
            f"{', '.join(sorted(CLIENT_ENV))})"
        )
    try:
        return HubSettings(**data)
    except ValidationError as e:
        raise SettingsError(_describe(e, where, env_keys)) from None


def _describe(error: ValidationError, where: str, env_keys: dict[str, str]) -> str:
    lines = []
    known = ", ".join(sorted(HubSettings.model_fields))
    for err in error.errors():
        loc = ".".join(str(p) for p in err["loc"])
        top = str(err["loc"][0]) if err["loc"] else ""
        source = f"environment variable {env_keys[top]}" if top in env_keys else where
        if err["type"] == "extra_forbidden":
            hint = f" (known keys: {known})" if len(err["loc"]) == 1 else ""
            lines.append(f"{source}: unknown key '{loc}'{hint}")
        else:
            message = str(err["msg"]).removeprefix("Value error, ")
            lines.append(f"{source}: key '{loc}': {message}")
    return "invalid settings:\n  " + "\n  ".join(lines)
