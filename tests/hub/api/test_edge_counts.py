"""The edge's refusals (queue time, requests in progress) are counted in the metrics of the
hub that answered them, also when one app serves a second hub (its lifespan run again, as
test clients do)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from hub.api.edge import Edge
from hub.api.ingress import ROUTES, Head
from hub.metrics import HubMetrics
from hub.saturation import Saturated


def _refuse(
    edge: Edge, metrics: HubMetrics, sent: list[dict], saturated: Saturated | None = None
) -> None:
    async def send(message: dict) -> None:
        sent.append(message)

    head = Head(ROUTES["/v1/embeddings"], "emb", None, None, None)
    saturated = saturated or Saturated("emb", 3, "embedder", until=1e9, retry_after=2.0,
                                       message="queue over its bound", snapshot=None)  # fmt: skip
    hub = SimpleNamespace(metrics=metrics)
    asyncio.run(edge.refuse_saturated(hub, head, send, saturated))


def _count(metrics: HubMetrics, name: str, labels: dict[str, str]) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_each_hub_counts_the_refusals_it_answered() -> None:
    edge = Edge(max_in_progress=0, max_lag=0)
    first, second = HubMetrics(CollectorRegistry()), HubMetrics(CollectorRegistry())
    sent: list[dict] = []
    for metrics in (first, first, second):
        _refuse(edge, metrics, sent)
    answered = {"model": "emb", "version": "3", "endpoint": "embeddings", "status": "503"}
    shed = {"model": "emb", "version": "3", "reason": "queue_time"}
    assert _count(first, "hub_requests_total", answered) == 2
    assert _count(second, "hub_requests_total", answered) == 1
    assert _count(first, "hub_requests_shed_total", shed) == 2
    assert _count(second, "hub_requests_shed_total", shed) == 1
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert [m["status"] for m in starts] == [503, 503, 503]
    assert all((b"retry-after", b"2") in m["headers"] for m in starts)


def test_each_hub_counts_the_requests_its_edge_shed() -> None:
    edge = Edge(max_in_progress=1, max_lag=0)
    edge.in_progress = 1
    first, second = HubMetrics(CollectorRegistry()), HubMetrics(CollectorRegistry())
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    for metrics in (first, second, second):
        assert asyncio.run(edge.refused(SimpleNamespace(metrics=metrics), send))
    shed = {"model": "", "version": "", "reason": "in_progress"}
    assert _count(first, "hub_requests_shed_total", shed) == 1
    assert _count(second, "hub_requests_shed_total", shed) == 2
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert [m["status"] for m in starts] == [503, 503, 503]
    assert all(any(name == b"retry-after" for name, _ in m["headers"]) for m in starts)


def test_a_renewed_refusal_answers_with_its_own_message() -> None:
    """The answer of a remembered refusal is rendered once for all the requests it refuses,
    and again when the model's queue refuses anew (its estimate and Retry-After changed)."""
    edge, metrics, sent = Edge(max_in_progress=0, max_lag=0), HubMetrics(CollectorRegistry()), []
    first = Saturated("emb", 3, "embedder", until=1e9, retry_after=2.0,
                      message="2 inputs ahead", snapshot=None)  # fmt: skip
    renewed = Saturated("emb", 4, "embedder", until=1e9, retry_after=5.0,
                        message="9 inputs ahead", snapshot=None)  # fmt: skip
    for saturated in (first, first, renewed):
        _refuse(edge, metrics, sent, saturated)
    bodies = [json.loads(m["body"]) for m in sent if m["type"] == "http.response.body"]
    messages = [b["error"]["message"] for b in bodies]
    assert messages[0] == messages[1] and "2 inputs ahead" in messages[0]
    assert "9 inputs ahead" in messages[2] and "2 inputs ahead" not in messages[2]
    heads = [dict(m["headers"]) for m in sent if m["type"] == "http.response.start"]
    assert [h[b"retry-after"] for h in heads] == [b"2", b"2", b"5"]
    assert [h[b"x-hub-model-version"] for h in heads] == [b"3", b"3", b"4"]
    raw = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert [int(h[b"content-length"]) for h in heads] == [len(b) for b in raw]
