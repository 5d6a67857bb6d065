"""Everything one running hub holds, created in the app's lifespan and torn down with it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field

from backends.llm.structured.pool import CompilePool
from hub import gc_freeze
from hub.auth import Authenticator
from hub.catalog import Catalog
from hub.control import Control, build_registry
from hub.demo import is_builtin, materialise_builtin
from hub.dependencies import BoundedCalls, DependencyMonitor, DeviceMonitor
from hub.manager import Device, ModelManager, VersionLoader
from hub.metrics import HubMetrics
from hub.placement.service import Placement
from hub.promotion import Promoter
from hub.rate_limits.limiter import RateLimiter
from hub.rate_limits.sync import LimitSync
from hub.reconciler import Reconciler
from hub.replicas import Membership, replica_id
from hub.routing import Router
from hub.saturation import Saturation
from hub.serving import Serving
from hub.settings import HubSettings
from hub.sql_worker import SqlWorker
from hub.traffic.service import TrafficService
from hub.usage.meter import UsageMeter
from hub.usage.metrics import UsageMetrics
from hub.validation import ValidationGate
from hub.webhooks import EVENTS, WebhookVerifier
from registry.db import REGISTRATION_LOCK, Database, sqlite_path, upgrade
from registry.keys import ApiKeys
from registry.outage import dependency_down
from registry.rate_limits import RateLimitBook
from registry.replicas import membership_engine
from registry.service import Registry
from registry.usage import UsageBook, usage_engine

log = logging.getLogger(__name__)

# Seconds each step of `Hub.stop` may take (the deployment's grace period is 90 s; the
# manager's step unloads every model, an LLM engine's shutdown included).
SHUTDOWN_STEP_TIMEOUT = 20.0
# Seconds a device's probe kernel may take before the device counts as lost (the kernel
# runs on a stream of its own, so a long batch does not hold it up).
DEVICE_PROBE_TIMEOUT = 10.0


@dataclass
class Hub:
    """Every long-lived part of one running hub, wired once by `build` (no I/O), brought up
    by `start` (migrate, reach the database, register configured models, start the background
    loops; `ready` flips last) and torn down by `stop`. Routes never take the whole `Hub`:
    they declare the parts they use (hub.api.deps).

    Readiness (`readiness()`) means "this replica can serve": started, every configured
    preload attempted, the database answered within `registry.database_grace` seconds, and
    no configured device was lost (a crashed CUDA context: hub.dependencies.devices).
    MLflow down is reported, not fatal: the hub starts and serves from SQL and its local cache.
    """

    settings: HubSettings
    db: Database
    registry: Registry
    control: Control
    catalog: Catalog
    router: Router
    manager: ModelManager
    auth: Authenticator
    metrics: HubMetrics
    reconciler: Reconciler
    promoter: Promoter
    webhooks: WebhookVerifier | None
    traffic: TrafficService
    serving: Serving
    # Models the HTTP edge refuses at once while their queues drain (hub.saturation).
    saturation: Saturation
    replicas: Membership
    dependencies: DependencyMonitor
    placement: Placement
    # Usage metering (None when `usage.enabled` is off).
    usage: UsageMeter | None = None
    # Every limited key's buckets, the fleet's (hub.rate_limits), and their sync through SQL
    # (None with auth off: no key has limits).
    limits: RateLimiter = field(default_factory=RateLimiter)
    limit_sync: LimitSync | None = None
    ready: bool = False
    background: list[asyncio.Task[None]] = field(default_factory=list)
    # Configured models whose preload has not finished yet, and those whose preload failed.
    preloading: set[str] = field(default_factory=set)
    preload_failed: dict[str, str] = field(default_factory=dict)
    # Freeze the start-up heap out of the garbage collector's way once the preloads were
    # attempted (`hub.gc_freeze`); set by the process that owns the hub (`hub serve`).
    freeze_gc: bool = False
    # Where every LLM's grammars compile (backends/llm/structured/pool.py).
    grammar_pool: CompilePool | None = None

    @classmethod
    def build(cls, settings: HubSettings) -> Hub:
        """Wire the parts together; does no I/O (see `start`)."""
        devices = [Device.from_settings(d) for d in settings.devices]
        registry = build_registry(settings)
        db = registry.db
        metrics = HubMetrics()
        catalog = Catalog(registry)
        reg = settings.registry
        mlflow_calls = BoundedCalls(
            "mlflow", workers=reg.mlflow_workers, deadline=reg.mlflow_deadline
        )
        control = Control(registry, catalog, mlflow_calls, leftover_grace=reg.leftover_grace)
        # Each CUDA device runs a probe kernel on the same schedule (hub.dependencies.devices).
        probes = DeviceMonitor(
            [d.name for d in devices if d.is_cuda],
            interval=reg.health_interval,
            timeout=DEVICE_PROBE_TIMEOUT,
            metrics_registry=metrics.registry,
        )
        dependencies = DependencyMonitor(
            {"database": registry.db.ping, "mlflow": registry.mlflow.ping},
            interval=reg.health_interval,
            timeout=max(reg.database_timeout, reg.mlflow_timeout),
            # Embedded MLflow: its first check creates (migrates) the SQLite store.
            created_on_first_use={"mlflow"} if sqlite_path(settings.mlflow_tracking_uri) else (),
            metrics_registry=metrics.registry,
            devices=probes,
        )
        grammar_pool = CompilePool(
            settings.structured_outputs.compile_threads,
            settings.structured_outputs.compiles_per_caller,
        )
        loader = VersionLoader(
            registry,
            metrics_registry=metrics.registry,
            allow_pickle=settings.allow_pickle,
            trust_remote_code=settings.trust_remote_code,
            kernels=settings.engine.kernel_settings(),
            grammar_pool=grammar_pool,
            max_queue_time_ms=settings.max_queue_time_ms,
        )
        manager = ModelManager(
            settings.manager,
            devices,
            loader,
            metrics,
            host_cache_budget=settings.host_cache_budget,
            model_specs={spec.name: spec for spec in settings.models},
        )
        reconciler = Reconciler(
            control,
            manager,
            metrics,
            poll_interval=reg.poll_interval,
            version_check_every=reg.version_check_every,
            keep_loaded=frozenset(m.name for m in settings.models if m.preload),
            pinned=frozenset(m.name for m in settings.models if m.pin),
            # Before the first check (None) MLflow counts as up.
            mlflow_up=lambda: dependencies.state("mlflow").up is not False,
        )
        probes.on_lost(manager.device_lost)
        # MLflow back: catch up at once rather than at the next poll.
        dependencies.on_change(lambda name, up: reconciler.kick() if up else None)
        gate = ValidationGate(manager, reg.gate_timeout)
        secret = reg.webhook_secret.get_secret_value() if reg.webhook_secret else None
        promoter = Promoter(control, gate, require_staging=reg.require_staging)
        traffic = TrafficService(
            settings.traffic,
            control,
            manager,
            promoter,
            metrics.registry,
            require_staging=reg.require_staging,
            database_url=settings.database_url,
            replica=replica_id(settings),
        )
        replicas = Membership.for_hub(settings, manager, metrics.registry)
        saturation = Saturation(lambda: catalog.snapshot)
        usage = _usage_meter(settings, metrics)
        limits = RateLimiter()
        return cls(
            settings=settings,
            db=db,
            registry=registry,
            control=control,
            catalog=catalog,
            router=Router(catalog),
            manager=manager,
            auth=Authenticator(settings.auth, ApiKeys(db)),
            metrics=metrics,
            reconciler=reconciler,
            promoter=promoter,
            webhooks=WebhookVerifier(secret) if secret else None,
            traffic=traffic,
            serving=Serving(manager, traffic, metrics, saturation, usage),
            saturation=saturation,
            replicas=replicas,
            dependencies=dependencies,
            placement=Placement.for_hub(settings, replicas, manager, catalog, metrics.registry),
            grammar_pool=grammar_pool,
            usage=usage,
            limits=limits,
            limit_sync=_limit_sync(settings, limits, metrics),
        )

    async def start(self) -> None:
        """Migrate, reach the database, register configured models, then serve (MLflow may
        be down: what SQL and the local cache hold is served)."""
        # Start-up steps use the default executor: nothing is served yet, nothing waits.
        await asyncio.to_thread(upgrade, self.settings.database_url)
        await self.dependencies.check_now()
        database, mlflow = self.dependencies.state("database"), self.dependencies.state("mlflow")
        if not database.up:
            raise RuntimeError(f"the registry database does not answer: {database.error}")
        if not mlflow.up:
            log.warning("MLflow is unreachable (%s); serving what SQL and the local cache "
                        "hold, and catching up once it answers", mlflow.error)  # fmt: skip
        self.dependencies.start()
        await asyncio.to_thread(self._register_configured_models)
        await self._register_webhook()
        await self.reconciler.reconcile(check_versions=True)
        self.reconciler.start()
        await self.traffic.start()
        self.manager.start()
        await self.replicas.start()
        self.placement.start()
        if self.limit_sync is not None:
            self.limit_sync.start()
        if self.settings.auth.enabled:  # revocations reach this replica within a second
            self.background.append(asyncio.create_task(self.auth.watch(), name="key-generation"))
        self.preloading = {m.name for m in self.settings.models if m.preload or m.pin}
        if self.preloading:
            self.background.append(asyncio.create_task(self._preload(), name="preload"))
        elif self.freeze_gc:
            gc_freeze.freeze()
        self.ready = True

    def readiness(self) -> tuple[bool, dict[str, object]]:
        """Whether this replica can serve, and the body `/health/ready` answers; reads only
        state the background checks keep (never blocks on a dependency)."""
        states = self.dependencies.states()
        probes = self.dependencies.devices
        body: dict[str, object] = {
            "dependencies": {n: s.report() for n, s in states.items()},
            # The reconciler's check of MLflow against SQL waits while MLflow is down.
            "drift_check": "paused" if self.reconciler.drift_paused else "running",
        }
        if probes is not None and probes.devices:
            body["devices"] = {n: h.report() for n, h in probes.health().items()}
        if self.preload_failed:
            body["preload_failed"] = dict(self.preload_failed)
        if not self.ready:
            return False, {"status": "starting", **body}
        if self.preloading:
            return False, {"status": "preloading", "waiting_for": sorted(self.preloading), **body}
        database = states["database"]
        if not (database.up or database.fresh(self.settings.registry.database_grace)):
            return False, {"status": "registry database unavailable", **body}
        lost = probes.lost() if probes is not None else {}
        if lost:
            why = "; ".join(f"{d}: {reason}" for d, reason in sorted(lost.items()))
            return False, {"status": f"device unusable ({why})", **body}
        models = len(self.catalog.snapshot.models)
        return True, {"status": "ready", "models": models, **body}

    async def stop(self) -> None:
        """Tear down in order; a step that does not finish within `SHUTDOWN_STEP_TIMEOUT`
        is logged with what every task is waiting on, and the shutdown goes on: a stuck
        part never keeps the process (or a pod's termination) waiting for ever."""
        self.ready = False
        await _step("replica membership", self.replicas.stop())  # peers stop listing us
        for task in self.background:
            task.cancel()
        await _step("background tasks", asyncio.gather(*self.background, return_exceptions=True))
        await _step("traffic", self.traffic.stop())
        await _step("reconciler", self.reconciler.stop())
        await _step("placement", self.placement.close())
        await _step("model manager", self.manager.close())
        if self.usage is not None:  # after the last request was served
            await _step("usage", self.usage.stop())
        if self.limit_sync is not None:  # what the last requests consumed keeps counting
            await _step("rate limits", self.limit_sync.stop())
            self.limit_sync.close()
        if self.grammar_pool is not None:
            self.grammar_pool.close()
        await _step("dependency checks", self.dependencies.stop())
        self.control.close()
        self.catalog.close()
        self.auth.close()
        self.db.dispose()

    def _register_configured_models(self) -> None:
        if not self.settings.models:
            return
        # Replicas starting together on one database: one registers while the others wait
        # for the lock, then find the versions it made: one version per configured model, in
        # SQL and MLflow alike.
        with self.db.exclusive(REGISTRATION_LOCK, "registering the configured models"):
            self._register_missing_models()

    def _register_missing_models(self) -> None:
        snapshot = self.registry.snapshot()
        for spec in self.settings.models:
            existing = snapshot.models.get(spec.name)
            if existing is not None and existing.versions:
                continue  # a later start reuses what is registered
            source = spec.source
            if is_builtin(source):
                source = str(materialise_builtin(source, self.settings.demo_dir))
            log.info("registering configured model %s from %s", spec.name, spec.source)
            try:
                self.registry.register(
                    spec.name,
                    spec.kind,
                    source,
                    aliases=spec.aliases,
                    config=spec.config,
                    description=spec.description,
                    actor="config",
                    base=spec.base,
                )
            except Exception as e:
                if dependency_down(e) is None:
                    raise
                # MLflow (or the database) is down: serve the models that are registered;
                # this one is registered by the next start once it answers.
                log.error("cannot register configured model %s now: %s", spec.name, e)

    async def _register_webhook(self) -> None:
        reg = self.settings.registry
        if not (reg.webhook_url and reg.webhook_secret):
            return
        if not self.settings.mlflow_tracking_uri.startswith(("http://", "https://")):
            log.info("MLflow is embedded; alias moves are followed by polling, not webhooks")
            return
        try:
            await self.control.ensure_webhook(
                "model-hub", reg.webhook_url, reg.webhook_secret.get_secret_value(), EVENTS
            )
            log.info("MLflow webhook registered: alias moves are pushed to %s", reg.webhook_url)
        except Exception as e:  # polling still follows the registry
            log.warning("could not register the MLflow webhook (%s); polling only", e)

    async def _preload(self) -> None:
        """Load (or pin) each configured model; readiness waits until each was attempted."""
        for spec in self.settings.models:
            if not (spec.preload or spec.pin):
                continue
            try:
                route = self.router.route(spec.name)
                if spec.pin:
                    await self.manager.pin(route.name, route.version)
                else:
                    await self.manager.load(route.name, route.version)
            except Exception as e:
                self.preload_failed[spec.name] = str(e)
                log.error("preloading %s failed: %s", spec.name, e)
            finally:
                self.preloading.discard(spec.name)
        if self.freeze_gc:
            gc_freeze.freeze()


def _usage_meter(settings: HubSettings, metrics: HubMetrics) -> UsageMeter | None:
    """The usage writer, on an engine of its own with short timeouts (as the traffic
    statistics'), so the registry's pool never delays an answer's commit."""
    config = settings.usage
    if not config.enabled:
        return None
    return UsageMeter(
        UsageBook(usage_engine(settings.database_url, config.sql_timeout)),
        UsageMetrics(metrics.registry),
        commit_timeout=config.commit_timeout,
        retry_interval=config.retry_interval,
        sql_timeout=config.sql_timeout,
    )


def _limit_sync(
    settings: HubSettings, limits: RateLimiter, metrics: HubMetrics
) -> LimitSync | None:
    """The rate limits' sync, on an engine of its own with short timeouts (as the traffic
    statistics'); None with auth off, where no key and so no limit applies."""
    if not settings.auth.enabled:
        return None
    timeout = settings.replica.sql_timeout
    return LimitSync(
        limits,
        RateLimitBook(membership_engine(settings.database_url, timeout)),
        replica=replica_id(settings),
        interval=settings.auth.rate_limit_sync_interval,
        sql=SqlWorker(timeout, name="rate-limits-sql"),
        metrics=metrics.registry,
    )


async def _step(what: str, work: Awaitable[object]) -> None:
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task}, timeout=SHUTDOWN_STEP_TIMEOUT)
    if done:
        task.result()
        return
    others = [t for t in asyncio.all_tasks() if t is not task and t is not asyncio.current_task()]
    log.error(
        "shutdown: %s did not finish within %gs; going on without it. It waits in %s. "
        "Other tasks: %s",
        what, SHUTDOWN_STEP_TIMEOUT, _where(task),
        "; ".join(f"{t.get_name()} in {_where(t)}" for t in others) or "none",
    )  # fmt: skip
    task.cancel()
    await asyncio.wait({task}, timeout=1.0)


def _where(task: asyncio.Future[object]) -> str:
    frames = task.get_stack() if isinstance(task, asyncio.Task) else []
    return (
        " -> ".join(
            f"{f.f_code.co_name} ({f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno})"
            for f in frames
        )
        or "(not started)"
    )
