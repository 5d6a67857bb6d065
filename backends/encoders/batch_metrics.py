"""Prometheus metrics of the encoders' dynamic batching, labelled by model and version.

Every batcher of one hub registers on the hub's one `CollectorRegistry`; a collector can be
registered only once per registry, so the collectors are created once per registry and each
model version binds its own labelled children.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Gauge, Histogram

from backends.shed_metrics import ShedMetrics

_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


class _Collectors:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model", "version"]
        self.batch_size = Histogram(
            "hub_batch_size", "Inputs per forward batch", labels,
            buckets=_SIZE_BUCKETS, registry=registry,
        )  # fmt: skip
        self.batch_tokens = Histogram(
            "hub_batch_tokens", "Tokens per forward batch, before padding", labels,
            buckets=_TOKEN_BUCKETS, registry=registry,
        )  # fmt: skip
        self.batch_padded_tokens = Histogram(
            "hub_batch_padded_tokens", "Tokens per forward batch, padding included", labels,
            buckets=_TOKEN_BUCKETS, registry=registry,
        )  # fmt: skip
        self.forward_seconds = Histogram(
            "hub_batch_forward_seconds", "Time of one forward batch", labels,
            buckets=_SECONDS_BUCKETS, registry=registry,
        )  # fmt: skip
        self.queue_seconds = Histogram(
            "hub_batch_queue_seconds",
            "Time a request waited from submission until its first input's batch started",
            labels, buckets=_SECONDS_BUCKETS, registry=registry,
        )  # fmt: skip
        self.request_seconds = Histogram(
            "hub_batch_request_seconds",
            "Time from submission until a request's last input finished (queue, tokenizing, "
            "forward)",
            labels, buckets=_SECONDS_BUCKETS, registry=registry,
        )  # fmt: skip
        self.queued_inputs = Gauge(
            "hub_batch_queued_inputs", "Inputs waiting for a forward pass", labels,
            registry=registry,
        )  # fmt: skip


_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, _Collectors] = (
    weakref.WeakKeyDictionary()
)
_guard = threading.Lock()


class BatchMetrics:
    """The batching metrics of one model version; safe to call from any thread."""

    def __init__(self, registry: CollectorRegistry, model: str, version: str) -> None:
        collectors = _collectors(registry)
        labels = (model, version)
        self._size = collectors.batch_size.labels(*labels)
        self._tokens = collectors.batch_tokens.labels(*labels)
        self._padded = collectors.batch_padded_tokens.labels(*labels)
        self._forward = collectors.forward_seconds.labels(*labels)
        self._queue = collectors.queue_seconds.labels(*labels)
        self._request = collectors.request_seconds.labels(*labels)
        self._queued = collectors.queued_inputs.labels(*labels)
        self._shed = ShedMetrics(registry, model, version)

    def observe_batch(
        self, lengths: Sequence[int], forward_s: float, queued: int, *, unpadded: bool = False
    ) -> None:
        """One forward batch of inputs of these token `lengths` took `forward_s`; an unpadded
        batch (packed into one row) ran exactly its tokens."""
        self._size.observe(len(lengths))
        self._tokens.observe(sum(lengths))
        self._padded.observe(sum(lengths) if unpadded else len(lengths) * max(lengths, default=0))
        self._forward.observe(forward_s)
        self._queued.set(queued)

    def observe_request(self, queue_s: float, latency_s: float) -> None:
        """A request finished: `queue_s` until its first batch started, `latency_s` in all."""
        self._queue.observe(queue_s)
        self._request.observe(latency_s)

    def observe_shed(self, reason: str) -> None:
        """A request was refused before queueing, for `reason` (one of
        `backends.shed_metrics.SHED_REASONS`)."""
        self._shed.observe(reason)


def _collectors(registry: CollectorRegistry) -> _Collectors:
    with _guard:
        collectors = _by_registry.get(registry)
        if collectors is None:
            collectors = _by_registry[registry] = _Collectors(registry)
        return collectors
