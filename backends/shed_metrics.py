"""`hub_requests_shed_total`: requests refused with 503 before queueing, for every model kind.

The encoders' batcher, the LLM engine and the HTTP edge all count into the one counter of a
hub's `CollectorRegistry`; a collector can be registered only once per registry, so the
counter is created once per registry and each model version binds its own labelled children.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter

# Why a model's queue shed a request: it was full, or its estimated wait was too long. (The
# HTTP edge sheds for its own reason, with no model: hub/api/edge.py.)
SHED_REASONS = ("queue_full", "queue_time")

_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, Counter] = weakref.WeakKeyDictionary()
_guard = threading.Lock()


class ShedMetrics:
    """`hub_requests_shed_total` of one model version, for any kind (the LLM engine too), for
    each of `reasons` (shown at 0 from the start)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model: str,
        version: str,
        reasons: Sequence[str] = SHED_REASONS,
    ) -> None:
        shed = _counter(registry)
        self._by_reason = {reason: shed.labels(model, version, reason) for reason in reasons}

    def observe(self, reason: str) -> None:
        """A request was refused before queueing, for `reason` (one of its reasons)."""
        self._by_reason[reason].inc()


def _counter(registry: CollectorRegistry) -> Counter:
    with _guard:
        counter = _by_registry.get(registry)
        if counter is None:
            counter = _by_registry[registry] = Counter(
                "hub_requests_shed_total",
                "Requests refused with 503 before queueing: queue_full (max_queue inputs or "
                "max_waiting sequences wait), queue_time (the estimated wait exceeds "
                "max_queue_time_ms; refused by the model's queue, or at the HTTP edge while it "
                "drains), event_loop_lag or in_progress (max_requests_in_progress HTTP requests "
                "were in progress in the process; model and version empty)",
                ["model", "version", "reason"],
                registry=registry,
            )
        return counter
