"""`POST /webhooks/mlflow`: MLflow tells the hub an alias moved; the hub reconciles at once.

Authenticated by MLflow's HMAC signature (not an API key: MLflow cannot send one)."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Header, Request

from hub.api.bodies import parse_json_body
from hub.api.deps import ReconcilerDep, WebhooksDep
from hub.errors import BadRequest, NotFound

router = APIRouter(tags=["webhooks"])
log = logging.getLogger(__name__)


@router.post("/webhooks/mlflow")
async def mlflow_webhook(
    request: Request,
    webhooks: WebhooksDep,
    reconciler: ReconcilerDep,
    x_mlflow_signature: Annotated[str | None, Header()] = None,
    x_mlflow_timestamp: Annotated[str | None, Header()] = None,
    x_mlflow_delivery_id: Annotated[str | None, Header()] = None,
) -> dict[str, str]:
    if webhooks is None:
        raise NotFound("MLflow webhooks are not enabled (set registry.webhook_secret)")
    body = await request.body()
    webhooks.verify(x_mlflow_signature, x_mlflow_timestamp, x_mlflow_delivery_id, body)
    event = parse_json_body(body, "the webhook body")
    if not isinstance(event, dict):
        raise BadRequest("the webhook body must be a JSON object (an MLflow event)", param="body")
    what = f"{event.get('entity')}.{event.get('action')}: {event.get('data')}"
    log.info("MLflow webhook %s (%s); reconciling now", x_mlflow_delivery_id, what)
    # Reconcile before answering: once MLflow's delivery returns, the hub serves the move.
    await reconciler.reconcile()
    return {"status": "reconciled"}
