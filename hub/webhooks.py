"""MLflow webhook deliveries, verified before they are trusted.

MLflow signs `{delivery id}.{timestamp}.{body}` with HMAC-SHA256 under the webhook's secret
and sends `X-MLflow-Signature: v1,<base64>`, `X-MLflow-Timestamp` and
`X-MLflow-Delivery-Id`. A delivery is accepted only with a valid signature, a timestamp within
the tolerance (replay protection), and a delivery id not seen recently.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections import OrderedDict

from hub.errors import Unauthorized

SIGNATURE_HEADER = "X-MLflow-Signature"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
DELIVERY_HEADER = "X-MLflow-Delivery-Id"
SIGNATURE_VERSION = "v1"
EVENTS = ("model_version_alias.created", "model_version_alias.deleted")


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    content = f"{delivery_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret.encode(), content, hashlib.sha256).digest()
    return f"{SIGNATURE_VERSION},{base64.b64encode(digest).decode()}"


class WebhookVerifier:
    def __init__(self, secret: str, tolerance_s: float = 300.0, remember: int = 1024) -> None:
        self.secret = secret
        self.tolerance_s = tolerance_s
        self.remember = remember
        self._seen: OrderedDict[str, None] = OrderedDict()

    def verify(
        self, signature: str | None, timestamp: str | None, delivery_id: str | None, body: bytes
    ) -> None:
        if not (signature and timestamp and delivery_id):
            raise Unauthorized(
                f"missing {SIGNATURE_HEADER}, {TIMESTAMP_HEADER} or {DELIVERY_HEADER}"
            )
        try:
            age = abs(time.time() - int(timestamp))
        except ValueError:
            raise Unauthorized(f"{TIMESTAMP_HEADER} is not a unix timestamp") from None
        if age > self.tolerance_s:
            raise Unauthorized(f"webhook timestamp is {age:.0f}s off; possible replay")
        expected = sign(self.secret, delivery_id, timestamp, body)
        if not hmac.compare_digest(expected, signature):
            raise Unauthorized("webhook signature does not match the configured secret")
        if delivery_id in self._seen:
            raise Unauthorized(f"webhook delivery {delivery_id} was already received")
        self._seen[delivery_id] = None
        while len(self._seen) > self.remember:
            self._seen.popitem(last=False)
