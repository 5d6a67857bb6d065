"""Prometheus series of placement, on the app's registry (no `replica` label: Prometheus adds
the pod to every series it scrapes; `peer` is the replica id a request was forwarded to)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class PlacementMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "hub_placement_decisions_total",
            "Placement decisions by rule: resident_here, resident_peer, warm_here, warm_peer, "
            "fits_here, room_peer, evict_here (see hub/placement/decision.py)",
            ["reason"],
            registry=registry,
        )
        self.forwarded = Counter(
            "hub_forwarded_requests_total",
            "Requests this replica forwarded, by peer and outcome: ok (the peer's answer, "
            "whatever its status, was passed on), unreachable (nothing came back: tried the "
            "next holder or served here), timeout (503), broken (cut mid-answer)",
            ["peer", "outcome"],
            registry=registry,
        )
        self.copies_released = Counter(
            "hub_placement_copies_released_total",
            "Idle copies of models that a peer serves, moved off this replica's devices",
            registry=registry,
        )
        self.loads_avoided = Counter(
            "hub_placement_loads_avoided_total",
            "Requests served by a peer already holding the model that this replica would "
            "have had to load or restore",
            registry=registry,
        )
        self.hops_refused = Counter(
            "hub_hops_refused_total",
            "Requests whose hop headers (X-Hub-Forwarded-By) were ignored, so they were "
            "served as a client's: unsigned, no_secret (replica.hop_secret not set here), "
            "bad_signature (another secret: check every replica has the same), stale",
            ["reason"],
            registry=registry,
        )
