"""Prometheus metrics of the hub itself (requests, model loads); one registry per app, so
several apps in one process (tests) never collide. Backends register theirs on the same
registry through their BackendContext."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Adapter loads take milliseconds (a few MB, no base reload).
ADAPTER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)


class HubMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "hub_requests_total",
            "Inference requests by model, version, endpoint and HTTP status",
            ["model", "version", "endpoint", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "hub_request_seconds",
            "End-to-end inference request latency",
            ["model", "version", "endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.loads = Counter(
            "hub_model_loads_total",
            "Model loads by outcome (ok, no_room, dependency_down, failed, timeout: cancelled "
            "past load_timeout) and source (cold: from disk, warm: from the host tier)",
            ["model", "version", "outcome", "source"],
            registry=r,
        )
        self.load_seconds = Histogram(
            "hub_model_load_seconds",
            "Time to bring a model onto its device",
            ["source"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.adapter_loads = Counter(
            "hub_adapter_loads_total",
            "LoRA adapters brought onto their base's engine, by source (cold: read from disk, "
            "warm: its host-memory copy made servable again)",
            ["base", "model", "version", "source"],
            registry=r,
        )
        self.adapter_load_seconds = Histogram(
            "hub_adapter_load_seconds",
            "Time to bring a LoRA adapter onto its (resident) base, by source",
            ["source"],
            buckets=ADAPTER_BUCKETS,
            registry=r,
        )
        self.adapter_requests = Counter(
            "hub_adapter_requests_total",
            "Requests served by a LoRA adapter on its base's engine",
            ["base", "model", "version"],
            registry=r,
        )
        self.evictions = Counter(
            "hub_model_evictions_total",
            "Models moved off their device (or dropped from the host tier), by reason: "
            "pressure, keep_alive, admin, host_tier, overflow, shutdown",
            ["model", "version", "reason"],
            registry=r,
        )
        self.load_wait_seconds = Histogram(
            "hub_load_wait_seconds",
            "Time requests waited for their model to load",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.resident_bytes = Gauge(
            "hub_resident_bytes", "Bytes of models resident per device", ["device"], registry=r
        )
        self.loaded_models = Gauge(
            "hub_loaded_models", "Models loaded per device", ["device"], registry=r
        )
        self.host_tier_bytes = Gauge(
            "hub_host_tier_bytes", "Bytes of evicted weights parked in host memory", registry=r
        )
        self.host_tier_models = Gauge(
            "hub_host_tier_models", "Models parked in the host tier (state warm)", registry=r
        )
        self.registry_drift = Gauge(
            "hub_registry_drift",
            "Unrepaired differences between MLflow and the hub's SQL metadata",
            ["kind"],
            registry=r,
        )
