"""Hub settings: a YAML file plus `HUB_` environment overrides, read once at start.

`load_settings(path)` is the only reader. An unknown key or a bad value raises
`SettingsError` with one line per problem naming the key and where it came from (the file or
the environment variable); the CLI prints it and exits with code 2. Nothing below `hub/` reads
the environment: subsystems receive these frozen objects.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic import field_validator as validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from backends.llm.kernel_settings import KernelSettings
from backends.runtime_config import RuntimeConfigError, parse_runtime_config
from hub.units import parse_bytes, parse_duration

ENV_PREFIX = "HUB_"
CONFIG_ENV = "HUB_CONFIG"
# Variables the `hub` command reads as a client of a running hub (`--url`, `--key`); they
# share the prefix but are no settings of the server, so the loader neither reads nor
# refuses them. Any other HUB_ variable must name a setting.
CLIENT_ENV = frozenset({"HUB_URL", "HUB_API_KEY"})


class SettingsError(Exception):
    """Settings that cannot be used; the message names every offending key."""


def _budget(value: Any) -> int | float:
    """A memory budget: bytes (`4GiB`, 4294967296) or a fraction of the device (`0.8`, `80%`)."""
    if isinstance(value, str) and value.strip().endswith("%"):
        value = float(value.strip()[:-1]) / 100
    elif isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return parse_bytes(value)
    if isinstance(value, float) and 0 < value <= 1:
        return value
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ValueError(f"{value!r} is neither a byte size (4GiB) nor a fraction in (0, 1] (0.8, 80%)")


ByteSize = Annotated[int, BeforeValidator(parse_bytes)]
Budget = Annotated[int | float, BeforeValidator(_budget)]
Seconds = Annotated[float, BeforeValidator(parse_duration)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeviceSettings(_Section):
    name: str
    # Bytes, or a fraction of the device's total memory.
    memory_budget: Budget = 0.9

    @validator("name")
    @classmethod
    def _device_name(cls, v: str) -> str:
        if v != "cpu" and not re.fullmatch(r"cuda:\d+", v):
            raise ValueError(f"{v!r} is not a device; use 'cpu' or 'cuda:N'")
        return v


class AuthSettings(_Section):
    enabled: bool = False
    # Optional key accepted as an admin key, for bootstrapping before any key is created.
    bootstrap_admin_key: SecretStr | None = None
    # How often each replica writes what its rate-limited keys consumed to SQL and reads the
    # other replicas' (hub/rate_limits/sync.py): together the replicas admit at most a
    # limit plus about this long's worth of requests.
    rate_limit_sync_interval: Seconds = Field(default=0.5, gt=0, le=60)


class StructuredOutputSettings(_Section):
    """The hub's grammar compiles (backends/llm/structured/pool.py): threads of their own,
    shared by every LLM, and how many compiles one caller (an API key; the client's address
    with auth off) may hold, queued or running; one more is a 503 with Retry-After. Each
    model's size and time limits are in its runtime config (`max_grammar_bytes`, ...)."""

    compile_threads: int = Field(default=2, ge=1, le=64)
    compiles_per_caller: int = Field(default=4, ge=1, le=1024)


class ModelSpec(_Section):
    """A model the hub registers (if not yet registered) and optionally preloads at start."""

    name: str
    kind: Literal["llm", "embedder", "reranker"]
    # A folder, hf://org/name[@rev], an MLflow URI, or builtin:<demo model>.
    source: str
    # For a PEFT LoRA adapter source: the llm it runs on, `name@version-or-alias` (list
    # the base before its adapters).
    base: str | None = None
    aliases: list[str] = Field(default_factory=list)
    config: dict[str, Any] = Field(default_factory=dict)
    description: str = ""
    # Load at start; `pin` also pins the serving version (never evicted), and the pin moves
    # with the production alias.
    preload: bool = False
    pin: bool = False
    # How long it stays resident once idle (a duration, 0, or -1 forever); default: the
    # manager's. A version's runtime config `keep_alive` wins over this.
    keep_alive: Seconds | None = None
    # The device it must be placed on (one of `devices`); default: placement chooses.
    device: str | None = None

    @validator("config")
    @classmethod
    def _config_checks(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        # The raw mapping is what gets registered; it is checked here so a typo stops the
        # hub at start, naming the model and the key, instead of failing at first load.
        kind = info.data.get("kind")
        if kind is None:
            return v  # the kind's own error is reported
        try:
            parse_runtime_config(kind, v)
        except RuntimeConfigError as e:
            name = info.data.get("name", "?")
            raise ValueError(f"model {name!r}: config.{e.key}: {e.reason}") from None
        return v


class ManagerSettings(_Section):
    # How long a request waits for its model to load (including room being made) before 503.
    load_timeout: Seconds = 120.0
    # Requests allowed to wait on one model's load; more get 503 with Retry-After.
    max_waiting_per_model: int = Field(default=256, ge=1)
    # Ollama's keep_alive: how long an idle model stays resident; -1 forever, 0 unload at once.
    keep_alive: Seconds = 300.0
    # Seconds suggested to clients in Retry-After when capacity is short.
    retry_after: Seconds = 2.0
    # Which idle models go first when a load needs room: GreedyDual-Size-Frequency (recency
    # weighted by reload cost per byte and use), least recently used, or largest first.
    eviction_policy: Literal["gdsf", "lru", "largest"] = "gdsf"
    # A model is not evicted for room until it has been resident this long (churn protection).
    min_residency: Annotated[float, BeforeValidator(parse_duration), Field(ge=0)] = 1.0
    # Extra headroom added to every predicted footprint; the CUDA allocator's rounding is
    # predicted per tensor and the CUDA context charged once per device without it.
    load_overhead_bytes: ByteSize = 0
    # The longest the keep-alive timer sleeps between checks (it also wakes on every change).
    idle_check_interval: Annotated[float, BeforeValidator(parse_duration), Field(gt=0)] = 5.0


class RegistrySettings(_Section):
    # How often the hub re-reads the registry (aliases, versions) to follow changes.
    poll_interval: Seconds = Field(default=2.0, gt=0)
    # Every this many polls, also compare version lists between MLflow and SQL.
    version_check_every: int = Field(default=10, ge=1)
    # Production only for versions that passed staging (their gate) first.
    require_staging: bool = True
    # Longest a validation gate (load + smoke + evaluation set) may take.
    gate_timeout: Seconds = Field(default=300.0, gt=0)
    # MLflow server webhooks: the secret MLflow signs deliveries with, and the URL at which
    # MLflow reaches this hub (`.../webhooks/mlflow`); with both set, the hub registers the
    # webhook itself at start.
    webhook_secret: SecretStr | None = None
    webhook_url: str | None = None
    # Hugging Face cache for hf:// sources (default: the huggingface_hub default).
    hf_cache_dir: Path | None = None
    # What an interrupted registration left in MLflow (a run without a version, an empty
    # model) is removed at start and in the version check once this old: a registration
    # still in progress, here or in another replica, is younger (registry/leftovers.py).
    leftover_grace: Seconds = Field(default=3600.0, ge=0)
    # ---- dependencies down: bounded MLflow and database calls ----
    # MLflow's HTTP client: the longest one request waits (to connect, then for each read)
    # and how often a failed one is retried. MLflow's own defaults (120 s, 7 retries with
    # backoff) held a call for minutes during an outage.
    mlflow_timeout: Seconds = Field(default=10.0, ge=1)
    mlflow_max_retries: int = Field(default=1, ge=0, le=10)
    # MLflow calls on the control path (alias moves, drift checks) run on this many threads
    # of their own; one more while all are busy answers 503 at once instead of queueing.
    mlflow_workers: int = Field(default=4, ge=1)
    # The longest such a call is awaited (registrations, which upload files, are exempt).
    mlflow_deadline: Seconds = Field(default=30.0, gt=0)
    # The longest one SQL statement, or a connection attempt, may take (PostgreSQL).
    database_timeout: Seconds = Field(default=10.0, gt=0)
    # How often the database and MLflow are checked in the background (readiness, metrics).
    health_interval: Seconds = Field(default=2.0, gt=0)
    # Readiness holds this long after the database last answered, so a short blip does not
    # take every replica out of the Service at once.
    database_grace: Seconds = Field(default=15.0, ge=0)


class TrafficSettings(_Section):
    """Versioned routing: shadow traffic, per-version statistics shared through SQL, canaries."""

    # Mirror jobs waiting for a shadow worker; when full, new mirrors are dropped (counted),
    # never waited for.
    shadow_queue_size: int = Field(default=64, ge=1)
    # Concurrent shadow replays.
    shadow_workers: int = Field(default=1, ge=1)
    # Run a mirror only in an idle moment of the hub (no request in flight) likely to hold
    # the whole replay, so the shadow does not compete with primaries for cores (CPU hubs);
    # a mirror that found none within shadow_max_wait is dropped (counted).
    shadow_when_idle: bool = True
    shadow_max_wait: Seconds = Field(default=5.0, gt=0)
    # Shadow samples kept in memory per shadow version for the readout's shadow section;
    # the oldest are forgotten first.
    sample_window: int = Field(default=10_000, ge=100)
    # How often the canary controller looks at running canaries.
    canary_tick: Seconds = Field(default=1.0, gt=0)
    # How often this replica writes its per-version traffic counts and latency histograms
    # to SQL, where readouts and canaries add up every replica's.
    stats_flush_interval: Seconds = Field(default=2.0, gt=0)
    # Rows of traffic statistics not rewritten for this long are deleted.
    stats_retention: Seconds = Field(default=7 * 24 * 3600.0, gt=0)
    # The longest one flush, statistics read or lease call may wait for the database.
    sql_timeout: Seconds = Field(default=3.0, gt=0)
    # One replica at a time analyses a canary, holding a lease it renews each tick (and
    # during a long validation gate); if it dies, another takes the canary over this long
    # after its last renewal. Keep it a few times canary_tick.
    canary_lease: Seconds = Field(default=15.0, gt=0)
    # Below this many requests per version a readout reports "insufficient data" instead of
    # a p-value.
    min_samples: int = Field(default=30, ge=2)


class UsageSettings(_Section):
    """Usage metering (hub.usage): per caller, model version and hour, in SQL."""

    enabled: bool = True
    # The longest an answer waits for its usage to be committed before it is sent anyway
    # (the counts stay queued and are written once the database answers).
    commit_timeout: Seconds = Field(default=2.0, gt=0)
    # How often a write is retried while the database fails.
    retry_interval: Seconds = Field(default=2.0, gt=0)
    # The longest one usage write or read may take in the database.
    sql_timeout: Seconds = Field(default=3.0, gt=0)


def _env_switch(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def _kernel_cache_default() -> Path | None:
    if os.environ.get("MODEL_HUB_KERNEL_CACHE"):
        return Path(os.environ["MODEL_HUB_KERNEL_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "model-hub" / "kernels"
    return None  # the backend's default, ~/.cache/model-hub/kernels


class EngineSettings(_Section):
    """Switches of the LLM engine's native CPU kernels, passed to every LLM backend at load.

    The defaults read the variables older releases honoured (`MODEL_HUB_CPU_KERNELS`,
    `MODEL_HUB_KERNEL_CACHE`, `CC`); `engine:` in the file and `HUB_ENGINE__*` win over them."""

    # Decode attention and few-row linear layers on a CPU (float32) in compiled C kernels;
    # false: the torch path.
    cpu_kernels: bool = Field(default_factory=lambda: _env_switch("MODEL_HUB_CPU_KERNELS", True))
    # Where compiled kernels are cached; default: $XDG_CACHE_HOME/model-hub/kernels.
    kernel_cache_dir: Path | None = Field(default_factory=_kernel_cache_default)
    # The C compiler, arguments allowed ("ccache gcc"); default: cc.
    cc: str = Field(default_factory=lambda: os.environ.get("CC") or "cc", min_length=1)

    def kernel_settings(self) -> KernelSettings:
        """What the LLM backends are given at load."""
        return KernelSettings(
            enabled=self.cpu_kernels, cache_dir=self.kernel_cache_dir, compiler=self.cc
        )


# ---- scale-out: replica membership ---------------------------------------------------------


# The shortest replica.hop_secret accepted: a guessable secret would let anyone re-route.
MIN_HOP_SECRET = 16


class ReplicaSettings(_Section):
    """How this hub process announces itself to the other replicas sharing its database."""

    # Unique among the replicas of one database; default `<hostname>-<port>` (in Kubernetes
    # the hostname is the pod name). A restarted process with the same id takes its row over.
    id: str | None = Field(default=None, min_length=1, max_length=200)
    # The base URL at which peers reach this replica; default http://<host>:<port> (the
    # hostname when the hub binds every interface). In Kubernetes: the pod IP, see deploy/.
    advertise_url: str | None = None
    # How often this replica writes its heartbeat row (what it holds, free memory, queue).
    heartbeat_interval: Seconds = Field(default=5.0, gt=0)
    # A replica whose last heartbeat is older than this is no longer listed (a few missed
    # beats); must exceed heartbeat_interval.
    expire_after: Seconds = Field(default=15.0, gt=0)
    # The longest one heartbeat (or a listing) may wait for the database.
    sql_timeout: Seconds = Field(default=3.0, gt=0)
    # On SIGTERM (a pod being stopped) the hub stops accepting connections and gives the
    # requests in flight, streams included, this long to finish before it cuts them.
    drain_timeout: Seconds = Field(default=30.0, ge=0)
    # Model-aware placement (hub/placement): a request for a model this replica does not
    # hold goes to a live peer that holds it, and loads prefer the replica with room. false:
    # every replica serves every request itself. With one replica nothing changes either way.
    placement: bool = True
    # A peer that does not accept the connection within this long is skipped (the next
    # holder is tried, else the request is served here).
    forward_connect_timeout: Seconds = Field(default=1.0, gt=0)
    # The longest a forwarded request waits for the peer's answer to start, and then for
    # each next chunk of it (a stream's tokens); past it the caller gets a 503.
    forward_timeout: Seconds = Field(default=300.0, gt=0)
    # A peer whose last heartbeat reported this many queued requests (in flight plus waiting
    # for a load) takes no forwards; the request goes to the next holder or is served here.
    forward_max_queue_depth: int = Field(default=32, ge=1)
    # The secret every replica of one database shares: a request a replica forwards carries
    # an HMAC of it (method, path, body, route, time), and a replica obeys the hop headers
    # of a request only when they are signed with it. Without it placement is off (every
    # request is served where it lands) and hop headers are ignored. `hop_secret_file`: a
    # file holding it (a mounted Kubernetes Secret), read once at start; set one of the two.
    hop_secret: SecretStr | None = None
    hop_secret_file: Path | None = None

    @model_validator(mode="before")
    @classmethod
    def _secret_from_file(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("hop_secret_file") is None:
            return data
        if data.get("hop_secret") is not None:
            raise ValueError("set one of replica.hop_secret and replica.hop_secret_file")
        path = Path(data["hop_secret_file"])
        try:
            secret = path.read_text().strip()
        except OSError as e:
            raise ValueError(f"hop_secret_file {str(path)!r} cannot be read: {e.strerror}") from e
        except UnicodeDecodeError as e:
            raise ValueError(f"hop_secret_file {str(path)!r} is not text: {e}") from e
        return {**data, "hop_secret": secret}

    @validator("hop_secret")
    @classmethod
    def _long_enough(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < MIN_HOP_SECRET:
            raise ValueError(
                f"replica.hop_secret has fewer than {MIN_HOP_SECRET} characters; "
                "make one with `openssl rand -hex 32`"
            )
        return v

    @model_validator(mode="after")
    def _expiry_after_beats(self) -> ReplicaSettings:
        if self.expire_after <= self.heartbeat_interval:
            raise ValueError(
                f"replica.expire_after ({self.expire_after}s) must exceed "
                f"replica.heartbeat_interval ({self.heartbeat_interval}s), else a live replica "
                "drops out of the list between two heartbeats"
            )
        return self

    @validator("advertise_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"https?://[^/\s]+/?", v):
            raise ValueError(f"{v!r} is not a base URL like http://10.0.0.7:8000")
        return v.rstrip("/") if v else v


# ---- end of scale-out settings -----------------------------------------------------------------


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
