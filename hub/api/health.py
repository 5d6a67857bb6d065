"""Probes and metrics: liveness, readiness ("this replica can serve"), Prometheus, and
`GET /health` for clients that probe a server before using it (guidellm, TGI's clients).

No probe calls a dependency: readiness reads the state the background checks keep
(hub.dependencies), so a probe answers at once and never leaves a thread behind, whatever
the database or MLflow are doing."""

from __future__ import annotations

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
    """200 whenever the process answers, as /health/live; `ready` is /health/ready's verdict."""
    ready, _ = hub.readiness()
    return {"status": "ok", "ready": ready}


@router.get("/health/ready")
async def ready(hub: HubDep) -> JSONResponse:
    """200 when this replica can serve: started, configured preloads attempted, and the
    registry database answered recently (`registry.database_grace`) and no device was lost
    (a probe kernel failed or hung: `devices` names it and why); else 503 with the
    reason in `status`. `dependencies` reports the database and MLflow either way: MLflow
    down does not make a replica unready (it serves from SQL and its local cache)."""
    ok, body = hub.readiness()
    if ok:
        return JSONResponse(body)
    return JSONResponse(body, 503, headers={"Retry-After": "2"})


@router.get("/metrics")
async def metrics(hub_metrics: MetricsDep) -> Response:
    return Response(generate_latest(hub_metrics.registry), media_type=CONTENT_TYPE_LATEST)
