"""MLflow's webhook answers 4xx in the error shape to any malformed delivery, and refuses a
replay for the whole tolerance window however many deliveries came in between."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from fastapi.testclient import TestClient

from hub.errors import Unauthorized
from hub.webhooks import WebhookVerifier, sign
from tests.hub.api.test_webhooks import SECRET, deliver, slow_poll_client  # noqa: F401


def _headers(raw: bytes, **overrides: bytes | str) -> dict[str, bytes | str]:
    ts, did = str(int(time.time())), str(uuid.uuid4())
    headers: dict[str, bytes | str] = {
        "Content-Type": "application/json",
        "X-MLflow-Signature": sign(SECRET, did, ts, raw),
        "X-MLflow-Timestamp": ts,
        "X-MLflow-Delivery-Id": did,
    }
    headers.update(overrides)
    return headers


def _error(r: object, status: int) -> str:
    assert r.status_code == status, r.text  # type: ignore[attr-defined]
    return str(r.json()["error"]["message"])  # type: ignore[attr-defined]


def test_malformed_deliveries_are_4xx_in_the_error_shape(
    slow_poll_client: TestClient,  # noqa: F811
) -> None:
    client = slow_poll_client
    raw = b'{"entity": "model_version_alias", "action": "created", "data": {}}'
    for header in ("X-MLflow-Signature", "X-MLflow-Delivery-Id"):
        r = client.post(
            "/webhooks/mlflow",
            content=raw,
            headers=_headers(raw, **{header: "v1,\xe9".encode("latin-1")}),
        )
        assert "ASCII" in _error(r, 401)
    for ts in ("\u0661\u0662", "9" * 5000, "-5", "1e9"):
        r = client.post(
            "/webhooks/mlflow",
            content=raw,
            headers=_headers(raw, **{"X-MLflow-Timestamp": ts.encode()}),
        )
        assert "timestamp" in _error(r, 401)
    # Correctly signed bodies that are not one JSON object.
    for body in (b"[1, 2]", b'"text"', b"null", b"{not json", b"\xff\xfe"):
        r = client.post("/webhooks/mlflow", content=body, headers=_headers(body))
        assert "body" in _error(r, 400)
    # A proper delivery still goes through.
    assert deliver(client, json.loads(raw)).status_code == 200


def test_a_replay_is_refused_for_the_whole_window_with_memory_bounded_by_time() -> None:
    now = [1_000_000.0]
    verifier = WebhookVerifier(SECRET, tolerance_s=300.0, clock=lambda: now[0])
    body = b"{}"

    def verify(did: str, ts: int) -> None:
        verifier.verify(sign(SECRET, did, str(ts), body), str(ts), did, body)

    verify("first", int(now[0]))
    for i in range(5000):  # far more than any count-bounded memory held
        now[0] += 0.05
        verify(f"other-{i}", int(now[0]))
    assert now[0] - 1_000_000.0 < 300
    with pytest.raises(Unauthorized, match="already received"):
        verify("first", 1_000_000)
    # Past the window the timestamp refuses the replay, and the old ids are forgotten.
    now[0] = 1_000_000.0 + 301 + 300
    with pytest.raises(Unauthorized, match="possible replay"):
        verify("first", 1_000_000)
    verify("fresh", int(now[0]))
    assert verifier.remembered == 1
