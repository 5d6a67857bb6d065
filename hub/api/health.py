"""Probes and metrics: liveness, readiness (migrated and the registry answers), Prometheus,
and `GET /health` for clients that probe a server before using it (guidellm, TGI's clients)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hub.api.deps import HubDep, MetricsDep

router = APIRouter(tags=["health"])


@router.get("/health/live")
async def live() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/health")
async def health(hub: HubDep) -> dict[str, str | bool]:
    """200 whenever the process answers, as /health/live; `ready` says whether it has
    finished starting (/health/ready also checks the registry)."""
    return {"status": "ok", "ready": hub.ready}


@router.get("/health/ready")
async def ready(hub: HubDep) -> JSONResponse:
    if not hub.ready:
        return JSONResponse({"status": "starting"}, 503, headers={"Retry-After": "2"})
    try:
        await asyncio.wait_for(hub.control.ping(), timeout=5)
    except Exception as e:
        return JSONResponse(
            {"status": "registry unavailable", "reason": str(e)}, 503, headers={"Retry-After": "5"}
        )
    return JSONResponse({"status": "ready", "models": len(hub.catalog.snapshot.models)})


@router.get("/metrics")
async def metrics(hub_metrics: MetricsDep) -> Response:
    return Response(generate_latest(hub_metrics.registry), media_type=CONTENT_TYPE_LATEST)
