"""Prometheus series of replica membership, on the app's registry. No series carries a
`replica` label: Prometheus adds the pod (Kubernetes service discovery or a ServiceMonitor)
to every series it scrapes, and `hub_replica_info` maps a pod's series to its replica id."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge


class ReplicaMetrics:
    def __init__(self, registry: CollectorRegistry, queue_depth: Callable[[], float]) -> None:
        self.heartbeats = Counter(
            "hub_replica_heartbeats_total",
            "Heartbeats of this replica by outcome: ok, failed (the database did not answer in "
            "time or refused), skipped (the previous one still had not returned)",
            ["outcome"],
            registry=registry,
        )
        self.last_heartbeat = Gauge(
            "hub_replica_last_heartbeat_timestamp_seconds",
            "Unix time of this replica's last successful heartbeat",
            registry=registry,
        )
        self.live = Gauge(
            "hub_replicas_live",
            "Live replicas (this one included) seen at the last successful heartbeat",
            registry=registry,
        )
        self.info = Gauge(
            "hub_replica_info",
            "Always 1; names this process's replica id and the address peers reach it at",
            ["replica", "address"],
            registry=registry,
        )
        self.queue_depth = Gauge(
            "hub_queue_depth",
            "Requests in flight plus requests waiting for their model to load, in this replica "
            "(what the HorizontalPodAutoscaler scales on)",
            registry=registry,
        )
        self.queue_depth.set_function(queue_depth)
