"""The hub's own SQL tables (SQLAlchemy 2.0 typed ORM), all prefixed `hub_`.

MLflow holds the artifacts, model versions and aliases; these tables hold what MLflow does
not: the model kind, the verified file manifest, runtime configuration, validation results,
the audit log of alias moves, traffic policies (splits, shadow, faults), canaries and API
keys. The prefix keeps them apart from
MLflow's own `registered_models` and `model_versions` when both share one database.
Constraint names follow a naming convention so migrations can alter them on SQLite too.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dict[str, Any]: JSON,
        dt.datetime: DateTime(timezone=True),
    }


class RegisteredModel(Base):
    __tablename__ = "hub_models"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    kind: Mapped[str] = mapped_column(String(16))
    description: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    versions: Mapped[list[ModelVersion]] = relationship(
        back_populates="model", cascade="all, delete-orphan", order_by="ModelVersion.version"
    )


class ModelVersion(Base):
    __tablename__ = "hub_model_versions"
    __table_args__ = (UniqueConstraint("model_id", "version"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("hub_models.id", ondelete="CASCADE"))
    # Same number as the MLflow model version, so both registries speak of one version.
    version: Mapped[int] = mapped_column(Integer)
    source_uri: Mapped[str] = mapped_column(Text)
    mlflow_model_uri: Mapped[str] = mapped_column(Text)
    mlflow_version: Mapped[str] = mapped_column(String(32))
    # Artifact location of the files in MLflow (what the cache downloads from).
    artifact_uri: Mapped[str] = mapped_column(Text)
    # {relative path: sha256 hex} of every file of the version.
    manifest: Mapped[dict[str, Any]] = mapped_column(JSON)
    total_bytes: Mapped[int] = mapped_column(BigInteger)
    dtype: Mapped[str] = mapped_column(String(16))
    runtime_config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # registered -> (validated | failed), by the last validation gate run
    status: Mapped[str] = mapped_column(String(16), default="registered")
    validation: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # The version's own evaluation set, run by the validation gate (see hub.validation).
    eval_set: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # A LoRA adapter's base: the registered LLM version it was trained against (an alias
    # given at registration is resolved then: an adapter fits one base's weights). Both
    # null for a full model.
    base_model: Mapped[str | None] = mapped_column(String(200), default=None)
    base_version: Mapped[int | None] = mapped_column(Integer, default=None)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)

    model: Mapped[RegisteredModel] = relationship(back_populates="versions")


class AliasEvent(Base):
    """One alias move (set, moved, removed, rollback); the audit log of the registry."""

    __tablename__ = "hub_alias_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(
        ForeignKey("hub_models.id", ondelete="CASCADE"), index=True
    )
    alias: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(16))
    # The version the alias points to after the event (None when removed) and before it.
    version: Mapped[int | None] = mapped_column(Integer)
    from_version: Mapped[int | None] = mapped_column(Integer)
    actor: Mapped[str] = mapped_column(String(200))
    reason: Mapped[str] = mapped_column(Text, default="")
    validation: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow, index=True)

    model: Mapped[RegisteredModel] = relationship()


class TrafficSplit(Base):
    """Share of a model's routed traffic (percent) that one version receives. The version
    belongs to `target_model_id`: the model itself, or another registered model of the same
    kind (an experiment across model families under one public name)."""

    __tablename__ = "hub_traffic_splits"
    __table_args__ = (UniqueConstraint("model_id", "target_model_id", "version"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("hub_models.id", ondelete="CASCADE"))
    target_model_id: Mapped[int] = mapped_column(ForeignKey("hub_models.id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    weight: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class TrafficPolicy(Base):
    """The rest of a model's traffic policy beside its split rows: the shadow version that a
    share of requests is mirrored to, injected faults, and a revision that every change
    (split, shadow, faults, a canary's step) increments."""

    __tablename__ = "hub_traffic_policies"

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(
        ForeignKey("hub_models.id", ondelete="CASCADE"), unique=True
    )
    shadow_model_id: Mapped[int | None] = mapped_column(
        ForeignKey("hub_models.id", ondelete="SET NULL"), default=None
    )
    shadow_version: Mapped[int | None] = mapped_column(Integer, default=None)
    shadow_percent: Mapped[float] = mapped_column(Float, default=0.0)
    # [{model, version, error_percent, delay_ms}], see registry.traffic.
    faults: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    revision: Mapped[int] = mapped_column(Integer, default=0)
    updated_by: Mapped[str] = mapped_column(String(200), default="")
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Canary(Base):
    """An automated canary: a version's share of traffic rises step by step while it stays
    within its thresholds against the baseline; the last step promotes it to production.
    At most one canary per model is `running` (a partial unique index, so replicas sharing
    the database cannot start two)."""

    __tablename__ = "hub_canaries"
    __table_args__ = (
        Index(
            "ix_hub_canaries_one_running",
            "model_id",
            unique=True,
            sqlite_where=text("state = 'running'"),
            postgresql_where=text("state = 'running'"),
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("hub_models.id", ondelete="CASCADE"))
    canary_version: Mapped[int] = mapped_column(Integer)
    # Production when the canary started; what a breach sends all traffic back to.
    baseline_version: Mapped[int] = mapped_column(Integer)
    # The canary's share of traffic at each step, percent, increasing.
    steps: Mapped[list[float]] = mapped_column(JSON)
    # Index into `steps`; len(steps) while the final promotion is under way.
    step_index: Mapped[int] = mapped_column(Integer, default=0)
    # Epoch seconds (the controller's clock) at which the current step began.
    step_started_at: Mapped[float] = mapped_column(Float)
    interval_s: Mapped[float] = mapped_column(Float)
    max_error_rate: Mapped[float] = mapped_column(Float)
    max_latency_ratio: Mapped[float] = mapped_column(Float)
    min_requests: Mapped[int] = mapped_column(Integer)
    # running -> promoted | rolled_back | aborted
    state: Mapped[str] = mapped_column(String(16), default="running")
    reason: Mapped[str] = mapped_column(Text, default="")
    # The last analysis that decided something (advance, rollback, promotion).
    last_check: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    actor: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(default=None)


class ApiKey(Base):
    """An API key, stored as a sha256 hash; the plain key is shown once at creation."""

    __tablename__ = "hub_api_keys"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    # First characters of the key, to tell keys apart in listings without revealing them.
    prefix: Mapped[str] = mapped_column(String(16))
    role: Mapped[str] = mapped_column(String(16))  # admin | user
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    # The models the key may use (names, `name@version`, `name@alias`); null: every model.
    models: Mapped[list[str] | None] = mapped_column(JSON, default=None)
    # {requests_per_minute, tokens_per_minute, tokens_per_day, max_concurrent}; null: none.
    limits: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # interactive | standard | batch: the scheduling class of the key's requests.
    priority: Mapped[str] = mapped_column(String(16), default="standard", server_default="standard")
    # After this instant the key is invalid; null: it never expires.
    expires_at: Mapped[dt.datetime | None] = mapped_column(default=None)


class KeyGeneration(Base):
    """One row counting changes to API keys: every create, update and revoke adds one, so
    each replica learns that its cache of verified keys is stale by reading one integer."""

    __tablename__ = "hub_key_generation"

    id: Mapped[int] = mapped_column(primary_key=True)
    generation: Mapped[int] = mapped_column(BigInteger, default=0)


class Replica(Base):
    """One live hub process sharing this database: its heartbeat row, rewritten every few
    seconds with what it holds and how busy it is; gone on a clean shutdown, ignored once
    `last_seen` is older than the expiry (a replica that died)."""

    __tablename__ = "hub_replicas"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    # The base URL at which peers reach this replica (http://10.0.0.7:8000).
    address: Mapped[str] = mapped_column(Text)
    # The hub's software version, to tell replicas apart during a rolling update.
    hub_version: Mapped[str] = mapped_column(String(32), default="")
    started_at: Mapped[dt.datetime] = mapped_column()
    last_seen: Mapped[dt.datetime] = mapped_column(index=True)
    # [{name, version, kind, state (loading | loaded | warm | ...), device, bytes, pinned,
    #   in_flight}]: every model resident on a device or parked warm in host memory.
    models: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    # [{name, budget_bytes, free_bytes}] per device, and the host tier's free bytes.
    devices: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    host_free_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    # Requests in flight plus requests waiting for a model to load.
    queue_depth: Mapped[int] = mapped_column(Integer, default=0)


class TrafficStatsRow(Base):
    """One hub process's traffic to one model version under one revision of the model's
    traffic policy: cumulative counts and a latency histogram, rewritten by that process
    every few seconds. Readouts and canaries add up the rows of every process (a replica
    that died keeps its last flushed row; a restarted one writes new rows under a new
    `incarnation`)."""

    __tablename__ = "hub_traffic_stats"
    __table_args__ = (
        UniqueConstraint("incarnation", "model_id", "version_label", "policy_revision"),
        Index("ix_hub_traffic_stats_model_revision", "model_id", "policy_revision"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("hub_models.id", ondelete="CASCADE"))
    # As the readout names versions: "3", or "other@3" for a version of another model.
    version_label: Mapped[str] = mapped_column(String(200))
    # The traffic policy's revision the process served under (0: no policy was ever set).
    policy_revision: Mapped[int] = mapped_column(Integer)
    replica: Mapped[str] = mapped_column(String(200))
    # Unique per process start, so a restarted replica never overwrites its old counts.
    incarnation: Mapped[str] = mapped_column(String(64))
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    routed: Mapped[int] = mapped_column(BigInteger, default=0)
    errors: Mapped[int] = mapped_column(BigInteger, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # Seconds spent on successful requests (tokens per second = tokens / busy_s).
    busy_s: Mapped[float] = mapped_column(Float, default=0.0)
    # {bucket index: count} of successful requests' latencies, see hub.traffic.histogram.
    latency: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, index=True)


class Lease(Base):
    """A named lease held by one replica until `expires_at` (renewed while it works): one
    canary analyst at a time (`canary:<model>`). A replica that dies stops renewing and
    another takes the lease over once it has expired."""

    __tablename__ = "hub_leases"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    holder: Mapped[str] = mapped_column(String(200))
    expires_at: Mapped[dt.datetime] = mapped_column()
    acquired_at: Mapped[dt.datetime] = mapped_column()


class UsageRow(Base):
    """Metered usage of one caller (the API key's name; "anonymous" with auth off) on one
    model version in one UTC hour, summed over every replica: each answered request adds its
    counts to its row (an upsert by increment), so the row is the total. Names, not foreign
    keys: usage outlives the key and the model it was metered under."""

    __tablename__ = "hub_usage"

    key_name: Mapped[str] = mapped_column(String(200), primary_key=True)
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    # The start of the hour (UTC) the requests were answered in.
    hour: Mapped[dt.datetime] = mapped_column(primary_key=True, index=True)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    # Requests that reached a model version and were answered with an error (4xx or 5xx, a
    # client that left included).
    errors: Mapped[int] = mapped_column(BigInteger, default=0)
    # Tokens read, as the answers' `usage.prompt_tokens` say: LLM prompts, embedding inputs,
    # rerank query-document pairs.
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # Embedders alone: inputs embedded and their tokens (also in prompt_tokens).
    embedded_inputs: Mapped[int] = mapped_column(BigInteger, default=0)
    embedded_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    rerank_documents: Mapped[int] = mapped_column(BigInteger, default=0)


class RateLimitSpendRow(Base):
    """What one hub process admitted for one rate-limited key in one time slot: requests and
    tokens, cumulative for the slot and rewritten by that process every sync interval (so
    replicas never write the same row). Every replica sums the other processes' rows to know
    a key's consumption across the fleet; a process that died keeps counting until its rows
    expire. `span` is the slot's length in seconds (one sixtieth of the limit's period) and
    `slot` the slot's index since the Unix epoch (its start is `slot * span`)."""

    __tablename__ = "hub_rate_limit_spend"

    key_name: Mapped[str] = mapped_column(String(200), primary_key=True)
    # Unique per process start, so a restarted replica never overwrites what it admitted.
    incarnation: Mapped[str] = mapped_column(String(64), primary_key=True)
    span: Mapped[int] = mapped_column(Integer, primary_key=True)
    slot: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    replica: Mapped[str] = mapped_column(String(200))
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # Once the slot is older than the limit's period it no longer counts: deleted after.
    expires_at: Mapped[dt.datetime] = mapped_column(index=True)
