"""FastAPI dependencies: each route declares the parts of the hub it uses.

    async def readout(name: str, router: RouterDep, traffic: TrafficDep) -> ReadoutPublic

Every dependency is `async` on purpose: FastAPI runs a plain `def` dependency in its thread
pool, a thread hop on every request for what is an attribute read.

The inference routes are the exception: each dependency FastAPI solves costs a request
several microseconds of event-loop time, and on those routes that time is paid by every
request of a burst, refused ones included. They declare their body alone
(hub.api.bodies.UserBody) and take the rest from the request with the plain functions
`router_of`, `serving_of` and `route_key_of` (hub.api.bodies).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from hub.api.ingress import head_of
from hub.api.keys_access import routes_for
from hub.auth import Authenticator, Caller
from hub.catalog import Catalog
from hub.control import Control
from hub.manager import ModelManager
from hub.metrics import HubMetrics
from hub.promotion import Promoter
from hub.reconciler import Reconciler
from hub.routing import DecidedRouter, Router
from hub.serving import Serving
from hub.settings import HubSettings
from hub.state import Hub
from hub.traffic.service import TrafficService
from hub.webhooks import WebhookVerifier


def hub_of(request: Request) -> Hub:
    hub: Hub = request.app.state.hub
    return hub


async def get_hub(request: Request) -> Hub:
    return hub_of(request)


async def get_manager(request: Request) -> ModelManager:
    return hub_of(request).manager


async def get_router(request: Request) -> Router:
    return router_of(request)


def router_of(request: Request) -> Router:
    """The hub's router, or one answering the version the ingress already decided for this
    request (placement, or the replica that forwarded it: hub.api.ingress), so that a
    request is routed once; limited to the models the caller's key may use."""
    router: Router = hub_of(request).router
    head = head_of(request.scope)
    if head is None:
        return router
    if head.route is not None:
        router = DecidedRouter(router, head.route)
    return routes_for(router, head.caller)


async def get_catalog(request: Request) -> Catalog:
    return hub_of(request).catalog


async def get_control(request: Request) -> Control:
    return hub_of(request).control


async def get_traffic(request: Request) -> TrafficService:
    return hub_of(request).traffic


async def get_metrics(request: Request) -> HubMetrics:
    return hub_of(request).metrics


async def get_promoter(request: Request) -> Promoter:
    return hub_of(request).promoter


async def get_reconciler(request: Request) -> Reconciler:
    return hub_of(request).reconciler


async def get_settings(request: Request) -> HubSettings:
    return hub_of(request).settings


async def get_auth(request: Request) -> Authenticator:
    return hub_of(request).auth


async def get_webhooks(request: Request) -> WebhookVerifier | None:
    return hub_of(request).webhooks


async def get_serving(request: Request) -> Serving:
    return serving_of(request)


def serving_of(request: Request) -> Serving:
    """The hub's `Serving`: how an inference route acquires and measures its model."""
    return hub_of(request).serving


HubDep = Annotated[Hub, Depends(get_hub)]
ManagerDep = Annotated[ModelManager, Depends(get_manager)]
RouterDep = Annotated[Router, Depends(get_router)]
CatalogDep = Annotated[Catalog, Depends(get_catalog)]
ControlDep = Annotated[Control, Depends(get_control)]
TrafficDep = Annotated[TrafficService, Depends(get_traffic)]
MetricsDep = Annotated[HubMetrics, Depends(get_metrics)]
PromoterDep = Annotated[Promoter, Depends(get_promoter)]
ReconcilerDep = Annotated[Reconciler, Depends(get_reconciler)]
SettingsDep = Annotated[HubSettings, Depends(get_settings)]
WebhooksDep = Annotated[WebhookVerifier | None, Depends(get_webhooks)]
ServingDep = Annotated[Serving, Depends(get_serving)]


async def require_user(
    auth: Annotated[Authenticator, Depends(get_auth)],
    authorization: Annotated[str | None, Header()] = None,
    x_api_key: Annotated[str | None, Header()] = None,
) -> Caller:
    return await auth.check(authorization, x_api_key, admin=False)


async def require_admin(
    auth: Annotated[Authenticator, Depends(get_auth)],
    authorization: Annotated[str | None, Header()] = None,
    x_api_key: Annotated[str | None, Header()] = None,
) -> str:
    return (await auth.check(authorization, x_api_key, admin=True)).name


# The authenticated admin's name, for the audit log.
AdminActor = Annotated[str, Depends(require_admin)]
# The caller of a user path: its key's name, role and policy (hub.auth.Caller).
CallerDep = Annotated[Caller, Depends(require_user)]
