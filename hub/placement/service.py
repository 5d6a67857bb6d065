"""Placement for one replica: decides where a routed request is served and forwards it (the
HTTP side is the middleware in hub.api.placement).

`decide(route)` turns what the manager holds here and what the peers' last heartbeats say
(`Membership.peers`) into the pure decision's inputs (hub.placement.decision); `forward`
tries the decision's peers in order. A peer that sent nothing back (refused, reset: it died)
is suspected for one heartbeat expiry: decisions leave it out until then, so requests go
elsewhere at once rather than after its row expires.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry
from starlette.types import Scope, Send

from hub.catalog import Catalog
from hub.manager import ModelManager
from hub.placement.decision import (
    RESIDENT_STATES,
    WARM_STATES,
    Decision,
    PlacementPolicy,
    Replica,
    decide,
)
from hub.placement.forwarding import ForwardBroken, Forwarder, PeerTimeout, PeerUnreachable
from hub.placement.metrics import PlacementMetrics
from hub.replicas import Membership
from hub.routing import Route
from hub.settings import HubSettings, ReplicaSettings
from registry.replicas import ReplicaView

log = logging.getLogger(__name__)


class Placement:
    """Contract: `active` is False with placement off or no live peer (then nothing changes:
    every request is served here). `decide` never does I/O. `forward` returns True once a
    peer's answer went to `send`, False when every peer was unreachable (serve here), and
    raises `PeerTimeout` (503) when a peer took the request and did not answer in time."""

    def __init__(
        self,
        settings: ReplicaSettings,
        membership: Membership,
        manager: ModelManager,
        catalog: Catalog,
        forwarder: Forwarder,
        metrics: PlacementMetrics,
        *,
        overhead_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.membership = membership
        self.manager = manager
        self.catalog = catalog
        self.forwarder = forwarder
        self.metrics = metrics
        self.overhead_bytes = overhead_bytes
        self.policy = PlacementPolicy(max_queue_depth=settings.forward_max_queue_depth)
        self._clock = clock
        # peer id -> clock time until which it is left out (it refused a connection).
        self._suspects: dict[str, float] = {}

    @classmethod
    def for_hub(
        cls,
        settings: HubSettings,
        membership: Membership,
        manager: ModelManager,
        catalog: Catalog,
        registry: CollectorRegistry,
    ) -> Placement:
        """Wired to the hub's membership (peers), manager (what is here) and metrics."""
        return cls(
            settings.replica,
            membership,
            manager,
            catalog,
            Forwarder(settings.replica, membership.id),
            PlacementMetrics(registry),
            overhead_bytes=settings.manager.load_overhead_bytes,
        )

    async def close(self) -> None:
        await self.forwarder.close()

    @property
    def id(self) -> str:
        return self.membership.id

    @property
    def active(self) -> bool:
        return self.settings.placement and bool(self._live_peers())

    # ---- decision ---------------------------------------------------------------------------
    def decide(self, route: Route) -> Decision:
        key = (route.name, route.version)
        status = {(m.name, m.version): m for m in self.manager.status()}
        mine = status.get(key)
        here = Replica(
            id=self.id,
            state=mine.state if mine is not None else None,
            free_bytes=max((d.free_bytes for d in self.manager.device_status()), default=0),
        )
        rows = self._live_peers()
        peers = [_replica(row, key) for row in rows]
        size = self._size(key, mine.predicted_bytes if mine else 0,
                          mine.measured_bytes if mine else 0, rows)  # fmt: skip
        decision = decide(here, peers, size, self.policy)
        self.metrics.decisions.labels(decision.reason).inc()
        return decision

    def _live_peers(self) -> list[ReplicaView]:
        """Peers whose heartbeat is still fresh now (the list is as old as the last beat),
        minus the suspects."""
        as_of = self.membership.peers_as_of
        if as_of is None:
            return []
        now = self._clock()
        age = max(0.0, now - as_of)
        self._suspects = {p: until for p, until in self._suspects.items() if until > now}
        return [
            row
            for row in self.membership.peers
            if row.id != self.id
            and row.seen_s_ago + age < self.settings.expire_after
            and row.id not in self._suspects
        ]

    def _size(
        self, key: tuple[str, int], predicted: int, measured: int, rows: Iterable[ReplicaView]
    ) -> int | None:
        """Expected bytes on a device: what this replica measured or predicted, else what a
        peer holding it reports, else the registered artifacts' size plus the load overhead."""
        if measured or predicted:
            return max(measured, predicted)
        for row in rows:
            for m in row.models:
                if _is(m, key) and m.get("state") in RESIDENT_STATES and m.get("bytes"):
                    return int(m["bytes"])
        model = self.catalog.snapshot.models.get(key[0])
        version = model.versions.get(key[1]) if model is not None else None
        if version is None or not version.total_bytes:
            return None
        return version.total_bytes + self.overhead_bytes

    # ---- forwarding -------------------------------------------------------------------------
    async def forward(
        self, decision: Decision, route: Route, scope: Scope, body: bytes, send: Send
    ) -> bool:
        for peer in decision.peers:
            try:
                await self.forwarder.forward(peer.address, scope, body, route, send)
            except PeerUnreachable as e:
                self._suspects[peer.id] = self._clock() + self.settings.expire_after
                self.metrics.forwarded.labels(peer.id, "unreachable").inc()
                log.warning("replica %s is unreachable (%s); left out for %.0fs",
                            peer.id, e, self.settings.expire_after)  # fmt: skip
                continue
            except PeerTimeout:
                self.metrics.forwarded.labels(peer.id, "timeout").inc()
                raise
            except ForwardBroken:
                self.metrics.forwarded.labels(peer.id, "broken").inc()
                return True
            self.metrics.forwarded.labels(peer.id, "ok").inc()
            if decision.avoids_load:
                self.metrics.loads_avoided.inc()
            return True
        return False


def _is(model: dict[str, Any], key: tuple[str, int]) -> bool:
    return model.get("name") == key[0] and model.get("version") == key[1]


def _replica(row: ReplicaView, key: tuple[str, int]) -> Replica:
    state = next((m.get("state") for m in row.models if _is(m, key)), None)
    if state not in RESIDENT_STATES | WARM_STATES:
        state = None  # evicting: on its way out, not worth sending a request after
    return Replica(
        id=row.id,
        state=state,
        free_bytes=max((int(d.get("free_bytes", 0)) for d in row.devices), default=0),
        queue_depth=row.queue_depth,
        address=row.address,
    )
