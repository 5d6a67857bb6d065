"""Everything one running hub holds, created in the app's lifespan and torn down with it."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from hub.auth import Authenticator
from hub.catalog import Catalog
from hub.control import Control, build_registry
from hub.demo import is_builtin, materialise_builtin
from hub.manager import Device, ModelManager, VersionLoader
from hub.metrics import HubMetrics
from hub.placement.service import Placement
from hub.promotion import Promoter
from hub.reconciler import Reconciler
from hub.replicas import Membership
from hub.routing import Router
from hub.serving import Serving
from hub.settings import HubSettings
from hub.traffic.service import TrafficService
from hub.validation import ValidationGate
from hub.webhooks import EVENTS, WebhookVerifier
from registry.db import REGISTRATION_LOCK, Database, upgrade
from registry.keys import ApiKeys
from registry.service import Registry

log = logging.getLogger(__name__)


@dataclass
class Hub:
    """Every long-lived part of one running hub, wired once by `build` (no I/O), brought up
    by `start` (migrate, reach the registry, register configured models, start the background
    loops; `ready` flips last) and torn down by `stop`. Routes never take the whole `Hub`:
    they declare the parts they use (hub.api.deps).
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
    replicas: Membership
    placement: Placement
    ready: bool = False
    background: list[asyncio.Task[None]] = field(default_factory=list)

    @classmethod
    def build(cls, settings: HubSettings) -> Hub:
        """Wire the parts together; does no I/O (see `start`)."""
        devices = [Device.from_settings(d) for d in settings.devices]
        registry = build_registry(settings)
        db = registry.db
        metrics = HubMetrics()
        catalog = Catalog(registry)
        control = Control(registry, catalog)
        loader = VersionLoader(
            registry,
            metrics_registry=metrics.registry,
            allow_pickle=settings.allow_pickle,
            trust_remote_code=settings.trust_remote_code,
            kernels=settings.engine.kernel_settings(),
        )
        manager = ModelManager(
            settings.manager,
            devices,
            loader,
            metrics,
            host_cache_budget=settings.host_cache_budget,
            model_specs={spec.name: spec for spec in settings.models},
        )
        reg = settings.registry
        reconciler = Reconciler(
            control,
            manager,
            metrics,
            poll_interval=reg.poll_interval,
            version_check_every=reg.version_check_every,
            keep_loaded=frozenset(m.name for m in settings.models if m.preload),
            pinned=frozenset(m.name for m in settings.models if m.pin),
        )
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
        )
        replicas = Membership.for_hub(settings, manager, metrics.registry)
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
            serving=Serving(manager, traffic, metrics),
            replicas=replicas,
            placement=Placement.for_hub(settings, replicas, manager, catalog, metrics.registry),
        )

    async def start(self) -> None:
        """Migrate, reach the registry, register configured models, then serve."""
        await asyncio.to_thread(upgrade, self.settings.database_url)
        await self.control.ping()
        await asyncio.to_thread(self._register_configured_models)
        await self._register_webhook()
        await self.reconciler.reconcile(check_versions=True)
        self.reconciler.start()
        await self.traffic.start()
        self.manager.start()
        await self.replicas.start()
        self.placement.start()
        self.ready = True
        preload = [m for m in self.settings.models if m.preload or m.pin]
        if preload:
            self.background.append(asyncio.create_task(self._preload(), name="preload"))

    async def stop(self) -> None:
        self.ready = False
        await self.replicas.stop()  # first: peers stop listing this replica at once
        for task in self.background:
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        await self.traffic.stop()
        await self.reconciler.stop()
        await self.placement.close()
        await self.manager.close()
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
            self.registry.register(
                spec.name,
                spec.kind,
                source,
                aliases=spec.aliases,
                config=spec.config,
                description=spec.description,
                actor="config",
            )

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
                log.error("preloading %s failed: %s", spec.name, e)
