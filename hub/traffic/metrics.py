"""Prometheus metrics of versioned routing, registered on the hub's own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hub.metrics import LATENCY_BUCKETS

SIMILARITY_BUCKETS = (0.0, 0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0)


class TrafficMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.shadow_requests = Counter(
            "hub_shadow_requests_total",
            "Mirrored requests by model, shadow version and outcome "
            "(ok, error, incomparable, dropped_full, dropped_stale)",
            ["model", "version", "outcome"],
            registry=r,
        )
        self.shadow_seconds = Histogram(
            "hub_shadow_seconds",
            "Latency of the shadow version's replay",
            ["model", "version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.shadow_similarity = Histogram(
            "hub_shadow_similarity",
            "Similarity of shadow and primary outputs (1 = identical)",
            ["model", "version"],
            buckets=SIMILARITY_BUCKETS,
            registry=r,
        )
        self.injected_faults = Counter(
            "hub_injected_faults_total",
            "Faults injected by traffic policies, by kind (error, delay)",
            ["model", "version", "fault"],
            registry=r,
        )
        self.canary_weight = Gauge(
            "hub_canary_weight_percent",
            "Share of traffic a running canary receives",
            ["model", "version"],
            registry=r,
        )
        self.canary_decisions = Counter(
            "hub_canary_decisions_total",
            "Canary decisions (advance, rollback, promote, abort)",
            ["model", "decision"],
            registry=r,
        )
        self.stats_flushes = Counter(
            "hub_traffic_stats_flushes_total",
            "Flushes of this replica's traffic statistics to SQL by outcome: ok, failed (the "
            "database did not answer in time or refused; the numbers wait for the next flush), "
            "skipped (the previous one still had not returned)",
            ["outcome"],
            registry=r,
        )
        self.stats_last_flush = Gauge(
            "hub_traffic_stats_last_flush_timestamp_seconds",
            "Unix time of this replica's last successful traffic statistics flush",
            registry=r,
        )
        self.canary_leases = Counter(
            "hub_canary_lease_total",
            "Attempts of this replica to take or renew a canary's analyst lease by outcome: "
            "held, standby (another replica analyses), failed (the database did not answer)",
            ["model", "outcome"],
            registry=r,
        )
