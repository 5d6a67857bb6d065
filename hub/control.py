"""The hub's control path to the registry: one async facade over SQL and MLflow.

The registry (registry/) is synchronous: SQLAlchemy sessions and MLflow's client block. Every
hub part that reads or writes it on the control path (admin routes, promotion, canaries, the
reconciler) goes through `Control`, which owns the steps they all share (probes
do not: they read the state hub.dependencies keeps):

- the thread hop: each call runs the blocking registry call in a worker thread, so the event
  loop keeps serving requests meanwhile. Calls that reach MLflow (alias moves, drift checks,
  registrations, the webhook) run on MLflow's own few threads with a deadline
  (`BoundedCalls`): an MLflow outage answers them 503 within the deadline and never takes
  the threads SQL-only calls need. Reads and traffic writes are SQL-only;
- outages named: a call that failed because the database or MLflow did not answer raises
  `DependencyUnavailable` (a 503 with Retry-After), whatever the library's own error was;
- "write, then refresh": a write that changes what is served (a registration, an alias move,
  a traffic policy, a canary step) refreshes the catalog before it returns, so this hub
  routes by the new state from the next request on (other replicas follow at their next
  reconcile). Writes that change nothing the router reads (validation results, rejected
  promotions) do not refresh.

`build_registry(settings)` is the one place the registry is wired from settings, for the app
(`Hub.build`) and the CLI alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from backends.workers import WorkerPool
from hub.catalog import Catalog
from hub.dependencies import BoundedCalls
from registry.canaries import CanarySpec
from registry.db import REGISTRATION_LOCK
from registry.drift import Drift, find_drift
from registry.leftovers import remove_leftovers
from registry.outage import outage_named
from registry.service import Registry
from registry.views import (
    CanaryView,
    EventView,
    FaultView,
    ModelView,
    RegistrySnapshot,
    ShadowView,
    SplitView,
    TrafficPolicyView,
    VersionView,
)

if TYPE_CHECKING:
    from hub.settings import HubSettings

T = TypeVar("T")


def build_registry(settings: HubSettings) -> Registry:
    """The registry the settings describe (SQL, MLflow, the artifact cache, the Hugging Face
    cache); does no I/O and runs no migration."""
    from backends.llm.architectures import folder_problem
    from backends.llm.speculative.compat import draft_problem
    from backends.runtime_config import parse_runtime_config
    from hub.adapters.checks import adapter_problem
    from hub.manager.devices import Device
    from registry.cache import ArtifactCache
    from registry.db import Database
    from registry.mlflow_store import HttpLimits, MlflowStore

    reg = settings.registry
    mlflow = MlflowStore(
        settings.mlflow_tracking_uri,
        settings.mlflow_artifact_location,
        limits=HttpLimits(reg.mlflow_timeout, reg.mlflow_max_retries),
    )
    return Registry(
        Database(settings.database_url, timeout=reg.database_timeout),
        mlflow,
        ArtifactCache(settings.cache_dir, mlflow),
        allow_pickle=settings.allow_pickle,
        hf_cache_dir=settings.registry.hf_cache_dir,
        check_config=parse_runtime_config,
        folder_check=folder_problem,
        adapter_check=adapter_problem,
        draft_check=draft_problem,
        trust_remote_code=settings.trust_remote_code,
        # A model whose config alone says it cannot fit the largest device is refused.
        max_model_bytes=max(
            (Device.from_settings(d).budget_bytes for d in settings.devices), default=None
        ),
    )


class Control:
    """Async access to the registry for the hub's control path.

    Contract: every method runs its registry call off the event loop and raises the
    registry's own errors (`registry.errors`, mapped to HTTP answers by hub.api.errors). A
    method documented as refreshing returns only after this hub's catalog shows the write; if
    that refresh fails the write stands and the error propagates (the reconciler's next pass
    catches up). Methods return the registry's frozen views, never ORM rows.
    """

    def __init__(
        self,
        registry: Registry,
        catalog: Catalog,
        mlflow_calls: BoundedCalls | None = None,
        leftover_grace: float = 3600.0,
    ) -> None:
        self.registry = registry
        self.catalog = catalog
        self.mlflow_calls = mlflow_calls or BoundedCalls("mlflow", workers=4, deadline=30.0)
        self.leftover_grace = leftover_grace
        # SQL-only registry calls of admin routes, on threads of their own (backends/workers.py).
        self.sql_threads = WorkerPool("registry-sql", 4)

    async def _sql(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A SQL-only registry call off the event loop (the database's own timeouts bound it)."""
        with outage_named("registry request"):
            return await self.sql_threads.run(fn, *args, **kwargs)

    async def _mlflow(
        self, fn: Callable[..., T], *args: Any, deadline: bool | None = True, **kwargs: Any
    ) -> T:
        """A registry call that reaches MLflow, on MLflow's bounded threads."""
        return await self.mlflow_calls.run(fn, *args, deadline=deadline, **kwargs)

    def close(self) -> None:
        self.mlflow_calls.close()
        self.sql_threads.close()

    # ---- health and the catalog ---------------------------------------------------------
    async def refresh(self) -> RegistrySnapshot:
        """Re-read the registry (SQL only) into the catalog the router serves from."""
        with outage_named("reading the registry"):
            return await self.catalog.refresh()

    async def find_drift(self, *, versions: bool) -> list[Drift]:
        """Differences between MLflow and SQL; alias drift is recorded in the audit log as
        MLflow's state (`versions`: compare the version lists too, a slower check, after
        removing what interrupted registrations left, reported as repaired drift)."""
        r = self.registry

        def check() -> list[Drift]:
            removed = self._remove_leftovers() if versions else []
            return removed + find_drift(r.db, r.mlflow, r.aliases, versions=versions, repair=True)

        return await self._mlflow(check)

    def _remove_leftovers(self) -> list[Drift]:
        r = self.registry
        # One replica at a time (PostgreSQL): the same lock as registering configured models.
        with r.db.exclusive(REGISTRATION_LOCK, "removing what interrupted registrations left"):
            removed = remove_leftovers(r.db, r.mlflow, grace=self.leftover_grace)
        return [
            Drift(item.model, "version", f"removed {item.detail}, left by an interrupted "
                  "registration", repaired=True)
            for item in removed
        ]  # fmt: skip

    async def ensure_webhook(
        self, name: str, url: str, secret: str, events: tuple[str, ...]
    ) -> None:
        """Create or update MLflow's webhook that tells this hub of alias moves."""
        await self._mlflow(self.registry.mlflow.ensure_webhook, name, url, secret, events)

    # ---- reads (from the registry itself, not the catalog) ------------------------------
    async def models(self) -> list[ModelView]:
        return await self._sql(self.registry.list_models)

    async def model(self, name: str) -> ModelView:
        return await self._sql(self.registry.get_model, name)

    async def version(self, name: str, version: int) -> VersionView:
        return await self._sql(self.registry.get_version, name, version)

    async def events(self, name: str | None = None, limit: int = 100) -> list[EventView]:
        return await self._sql(self.registry.events, name, limit)

    async def traffic(self, name: str) -> TrafficPolicyView:
        """The stored traffic policy of `name` (the default one when none is stored)."""
        return await self._sql(self.registry.traffic.get, name)

    async def passed_stage(self, name: str, version: int, alias: str = "staging") -> bool:
        return await self._sql(self.registry.aliases.passed_stage, name, version, alias)

    async def rollback_target(self, name: str) -> tuple[int, int]:
        """(production now, the version a rollback moves it back to)."""
        return await self._sql(self.registry.aliases.rollback_target, name)

    async def latest_canary(self, name: str) -> CanaryView | None:
        return await self._sql(self.registry.canaries.latest, name)

    async def running_canaries(self) -> list[CanaryView]:
        return await self._sql(self.registry.canaries.running)

    # ---- writes that change what is served (each refreshes the catalog) -----------------
    async def register(
        self,
        name: str,
        kind: str,
        source: str,
        *,
        aliases: Iterable[str] = (),
        config: Mapping[str, Any] | None = None,
        description: str = "",
        eval_set: Mapping[str, Any] | None = None,
        actor: str,
        base: str | None = None,
    ) -> VersionView:
        """Register a new version of `name` from `source` (a LoRA adapter with `base`);
        refreshes."""
        # No deadline: uploading a model's files takes as long as it takes (each MLflow
        # request is still bounded by the client's timeout).
        view = await self._mlflow(
            self.registry.register, name, kind, source, aliases=aliases, config=config,
            description=description, eval_set=eval_set, actor=actor, base=base,
            deadline=None,
        )  # fmt: skip
        await self.refresh()
        return view

    async def set_alias(
        self, name: str, alias: str, version: int | None, *, actor: str, reason: str = ""
    ) -> EventView:
        """Point a free-form alias at `version` (None removes it); refreshes."""
        event = await self._mlflow(
            self.registry.set_alias, name, alias, version, actor=actor, reason=reason
        )
        await self.refresh()
        return event

    async def move_alias(
        self,
        name: str,
        alias: str,
        version: int,
        *,
        actor: str,
        reason: str,
        action: str,
        expected: int | None,
        validation: dict[str, Any] | None = None,
    ) -> EventView:
        """Move `alias` (a stage) to `version`, compare-and-set against `expected`
        (ConflictError when another move came first); refreshes."""
        event = await self._mlflow(
            self.registry.aliases.move, name, alias, version, actor=actor, reason=reason,
            action=action, validation=validation, expected=expected,
        )  # fmt: skip
        await self.refresh()
        return event

    async def replace_traffic(
        self,
        name: str,
        splits: Sequence[SplitView],
        *,
        shadow: ShadowView | None,
        faults: Sequence[FaultView],
        actor: str,
    ) -> TrafficPolicyView:
        """Replace the traffic policy of `name` atomically; refreshes."""
        policy = await self._sql(
            self.registry.traffic.replace, name, splits, shadow=shadow, faults=faults, actor=actor
        )
        await self.refresh()
        return policy

    async def clear_traffic(self, name: str, *, actor: str) -> TrafficPolicyView:
        """Back to the default policy; refreshes."""
        policy = await self._sql(self.registry.traffic.clear, name, actor=actor)
        await self.refresh()
        return policy

    async def start_canary(
        self, name: str, version: int, *, baseline: int, spec: CanarySpec, actor: str, now: float
    ) -> CanaryView:
        """Record a running canary and its first step's split; refreshes."""
        canary = await self._sql(
            self.registry.canaries.start, name, version, baseline=baseline, spec=spec,
            actor=actor, now=now,
        )  # fmt: skip
        await self.refresh()
        return canary

    async def advance_canary(
        self, canary: CanaryView, *, now: float, check: dict[str, Any], actor: str
    ) -> CanaryView | None:
        """Move the canary to its next step (compare-and-set on the step); refreshes when it
        moved, None (and no refresh) when another replica moved it first."""
        advanced = await self._sql(
            self.registry.canaries.advance, canary, now=now, check=check, actor=actor
        )
        if advanced is not None:
            await self.refresh()
        return advanced

    async def finish_canary(
        self,
        canary: CanaryView,
        *,
        state: str,
        reason: str,
        splits: Sequence[SplitView],
        check: dict[str, Any] | None,
        actor: str,
    ) -> CanaryView | None:
        """End a running canary with `splits` as the new split; refreshes when it ended,
        None (and no refresh) when it was no longer running."""
        done = await self._sql(
            self.registry.canaries.finish, canary, state=state, reason=reason, splits=splits,
            check=check, actor=actor,
        )  # fmt: skip
        if done is not None:
            await self.refresh()
        return done

    # ---- writes the router does not read (no refresh) -----------------------------------
    async def record_validation(self, name: str, version: int, result: dict[str, Any]) -> None:
        await self._sql(self.registry.record_validation, name, version, result)

    async def record_rejection(
        self,
        name: str,
        alias: str,
        version: int,
        *,
        current: int | None,
        actor: str,
        reason: str,
        validation: dict[str, Any],
    ) -> EventView:
        """Audit a promotion whose gate failed; the alias does not move."""
        return await self._sql(
            self.registry.aliases.record_rejection, name, alias, version, current=current,
            actor=actor, reason=reason, validation=validation,
        )  # fmt: skip
