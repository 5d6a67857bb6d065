"""The application factory. `create_app(settings)` does no I/O: the lifespan migrates the
database, reaches the registry, registers configured models and starts background tasks;
readiness flips only after all of that succeeded."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp

from hub import __version__
from hub.api import (
    admin_models,
    completions,
    dashboard,
    embeddings,
    health,
    keys,
    models,
    registry,
    replicas,
    rerank,
    rerank_shapes,
    webhooks,
)
from hub.api import responses as responses_api
from hub.api import traffic as traffic_api
from hub.api import usage as usage_api
from hub.api.errors import error_responses, install_error_handlers
from hub.api.ingress import Ingress
from hub.settings import HubSettings
from hub.state import Hub

log = logging.getLogger(__name__)


class HubApp(FastAPI):
    """FastAPI with the hub's one ingress (hub.api.ingress: edge refusal, body limit,
    requests in flight, saturation refusal, placement) outside all of FastAPI's own layers
    (its error and telemetry wrappers): a refusal under a burst costs none of them.
    `settings` gives the ingress its bounds; the other arguments are FastAPI's."""

    def __init__(self, settings: HubSettings, **fastapi: Any) -> None:
        self.hub_settings = settings
        super().__init__(**fastapi)

    def build_middleware_stack(self) -> ASGIApp:
        settings = self.hub_settings
        return Ingress(
            super().build_middleware_stack(),
            max_in_progress=settings.max_requests_in_progress,
            max_lag=settings.max_event_loop_lag,
            max_body_bytes=settings.max_request_body_bytes,
        )


def _announce(hub: Hub) -> None:
    host = hub.settings.host if hub.settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
    base = f"http://{host}:{hub.settings.port}"
    embedders = [m.name for m in hub.catalog.snapshot.models.values() if m.kind == "embedder"]
    llms = [m.name for m in hub.catalog.snapshot.models.values() if m.kind == "llm"]
    lines = [f"Model Hub is serving at {base}  (dashboard: {base}/)"]
    if embedders or llms:
        lines.append("Try:")
    if embedders:
        lines.append(
            f"  curl -s {base}/v1/embeddings -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{embedders[0]}", "input": ["hello world"]}}\''
        )
    if llms:
        lines.append(
            f"  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{llms[0]}", "messages": [{{"role": "user", "content": "Hi"}}]}}\''
        )
    print("\n".join(lines), flush=True)


def create_app(
    settings: HubSettings, *, announce: bool = False, freeze_gc: bool = False
) -> FastAPI:
    """The hub as an ASGI app; `announce` prints the URL and a curl to try once ready;
    `freeze_gc` freezes the start-up heap out of the garbage collector's way once the
    preloads were attempted (`hub.gc_freeze`: a process-wide choice, for `hub serve`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        hub = Hub.build(settings)
        hub.freeze_gc = freeze_gc
        app.state.hub = hub
        await hub.start()
        log.info("hub ready: %d models registered", len(hub.catalog.snapshot.models))
        if announce:
            _announce(hub)
        try:
            yield
        finally:
            await hub.stop()

    # The ingress (HubApp) is outermost: an overloaded process refuses before anything else.
    app = HubApp(
        settings,
        title="Model Hub",
        version=__version__,
        summary="Many models, one pool of accelerator memory",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    # The error statuses each router's routes answer, documented in /openapi.json; every
    # route but the probes may get the edge's 503.
    inference = error_responses(400, 401, 404, 413, 503)
    admin = error_responses(400, 401, 403, 404, 409, 413, 503)
    # Inference first: a request's route is found by trying the routers in this order, and
    # the inference paths are the ones a burst hits (no two routers share a path).
    documented = {
        embeddings: inference,
        completions: inference,
        rerank: inference,
        rerank_shapes: inference,
        responses_api: inference,
        models: error_responses(401, 404, 503),
        health: {},
        dashboard: {},
        admin_models: admin,
        registry: admin,
        traffic_api: admin,
        usage_api: admin,
        replicas: error_responses(401, 403, 503),
        keys: error_responses(400, 401, 403, 404, 409, 503),
        webhooks: error_responses(400, 401, 404, 409, 413, 503),
    }
    for module, responses in documented.items():
        app.include_router(module.router, responses=responses)
    _document_validation_as_400(app)
    return app


def _document_validation_as_400(app: FastAPI) -> None:
    """FastAPI documents a 422 on every route with parameters; the hub answers validation
    errors with 400 in OpenAI's shape (hub.outcome), which the routers declare. Drop the
    automatic 422 entries (a promotion's failed gate keeps its own declared 422) and the
    schemas only they used, so the document says what the hub sends."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                responses = operation.get("responses", {})
                answer = responses.get("422", {})
                ref = answer.get("content", {}).get("application/json", {}).get("schema", {})
                if ref.get("$ref", "").endswith("/HTTPValidationError"):
                    del responses["422"]
        text = json.dumps(schema.get("paths", {}))
        schemas = schema.get("components", {}).get("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            if unused in schemas and f'/{unused}"' not in text:
                del schemas[unused]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
