"""The sections of the hub's settings file (`devices`, `auth`, `manager`, `registry`,
`traffic`, `usage`, `engine`, ...) and the value types they share: byte sizes, memory budgets
and durations, each accepted as a number or a string (`4GiB`, `80%`, `5m`). Every section is
frozen and refuses a key it does not know."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
)
from pydantic import field_validator as validator

from backends.llm.kernel_settings import KernelSettings
from backends.runtime_config import RuntimeConfigError, parse_runtime_config
from hub.units import parse_bytes, parse_duration


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


class Section(BaseModel):
    """A section of the settings file: frozen, and an unknown key is an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class DeviceSettings(Section):
    name: str
    # Bytes, or a fraction of the device's total memory.
    memory_budget: Budget = 0.9

    @validator("name")
    @classmethod
    def _device_name(cls, v: str) -> str:
        if v != "cpu" and not re.fullmatch(r"cuda:\d+", v):
            raise ValueError(f"{v!r} is not a device; use 'cpu' or 'cuda:N'")
        return v


class AuthSettings(Section):
    enabled: bool = False
    # Optional key accepted as an admin key, for bootstrapping before any key is created.
    bootstrap_admin_key: SecretStr | None = None
    # How often each replica writes what its rate-limited keys consumed to SQL and reads the
    # other replicas' (hub/rate_limits/sync.py): together the replicas admit at most a
    # limit plus about this long's worth of requests.
    rate_limit_sync_interval: Seconds = Field(default=0.5, gt=0, le=60)


class StructuredOutputSettings(Section):
    """The hub's grammar compiles (backends/llm/structured/pool.py): threads of their own,
    shared by every LLM, and how many compiles one caller (an API key; the client's address
    with auth off) may hold, queued or running; one more is a 503 with Retry-After. Each
    model's size and time limits are in its runtime config (`max_grammar_bytes`, ...)."""

    compile_threads: int = Field(default=2, ge=1, le=64)
    compiles_per_caller: int = Field(default=4, ge=1, le=1024)


class ModelSpec(Section):
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


class ManagerSettings(Section):
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


class RegistrySettings(Section):
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


class TrafficSettings(Section):
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


class UsageSettings(Section):
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


class EngineSettings(Section):
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
