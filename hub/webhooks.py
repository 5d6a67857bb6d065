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
from collections.abc import Callable

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
    """Accepts a delivery once: signed with the secret, its timestamp within `tolerance_s` of
    now, and its id not seen before. Ids are remembered until their timestamp leaves the
    window (after which the timestamp check refuses a replay anyway), so memory is bounded by
    the deliveries of one window, never by a count a flood could push a replay past.
    Malformed headers are refused like bad signatures (401), never a 500."""

    def __init__(
        self, secret: str, tolerance_s: float = 300.0, clock: Callable[[], float] = time.time
    ) -> None:
        self.secret = secret
        self.tolerance_s = tolerance_s
        self._clock = clock
        # delivery id -> when it can be forgotten, in order of arrival.
        self._seen: OrderedDict[str, float] = OrderedDict()

    @property
    def remembered(self) -> int:
        return len(self._seen)

    def verify(
        self, signature: str | None, timestamp: str | None, delivery_id: str | None, body: bytes
    ) -> None:
        if not (signature and timestamp and delivery_id):
            raise Unauthorized(
                f"missing {SIGNATURE_HEADER}, {TIMESTAMP_HEADER} or {DELIVERY_HEADER}"
            )
        for name, value in ((SIGNATURE_HEADER, signature), (DELIVERY_HEADER, delivery_id)):
            if not value.isascii() or len(value) > 256:
                raise Unauthorized(f"{name} must be ASCII of at most 256 characters")
        # ASCII digits only: int() also reads "١٢٣", which is no unix timestamp.
        if not (timestamp.isascii() and timestamp.isdigit() and len(timestamp) <= 12):
            raise Unauthorized(f"{TIMESTAMP_HEADER} is not a unix timestamp")
        now = self._clock()
        sent_at = int(timestamp)
        age = abs(now - sent_at)
        if age > self.tolerance_s:
            raise Unauthorized(f"webhook timestamp is {age:.0f}s off; possible replay")
        expected = sign(self.secret, delivery_id, timestamp, body)
        if not hmac.compare_digest(expected.encode(), signature.encode()):
            raise Unauthorized("webhook signature does not match the configured secret")
        self._forget_expired(now)
        if delivery_id in self._seen:
            raise Unauthorized(f"webhook delivery {delivery_id} was already received")
        self._seen[delivery_id] = sent_at + self.tolerance_s

    def _forget_expired(self, now: float) -> None:
        # Arrival order is nearly expiry order; an entry behind one not yet expired is kept
        # a little longer, never dropped early.
        while self._seen:
            first = next(iter(self._seen.values()))
            if first >= now:
                break
            self._seen.popitem(last=False)
