"""Placement for one replica: decides where a routed request is served and forwards it (the
HTTP side is the ingress's placement step in hub.api.placement). It needs
`replica.hop_secret`: without it no forward could be signed, and every request is served
where it lands.

`decide(route)` turns what the manager holds here and what the peers' last heartbeats say
(`Membership.peers`) into the pure decision's inputs (hub.placement.decision); `forward`
tries the decision's peers in order. A peer that sent nothing back (refused, reset: it died)
is suspected for one heartbeat expiry: decisions leave it out until then, so requests go
elsewhere at once rather than after its row expires.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry
from starlette.types import Scope, Send

from hub.catalog import Catalog
from hub.manager import ModelManager, ModelStatus
from hub.periodic import cancel_and_wait
from hub.placement.decision import (
    RESIDENT_STATES,
    WARM_STATES,
    Decision,
    PlacementPolicy,
    Replica,
    decide,
    spare_copies,
)
from hub.placement.forwarding import (
    ForwardBroken,
    Forwarder,
    HopSigner,
    PeerTimeout,
    PeerUnreachable,
)
from hub.placement.metrics import PlacementMetrics
from hub.replicas import Membership
from hub.routing import Route
from hub.settings import HubSettings, ReplicaSettings
from registry.replicas import ReplicaView

log = logging.getLogger(__name__)

# A decision that starts a load re-reads the peers' rows first when the view is older than
# this (what the peers hold changes fastest while models move), waiting for the database
# at most REFRESH_TIMEOUT (then it decides on the view it has).
REFRESH_AFTER = 0.05
REFRESH_TIMEOUT = 0.25
# After this replica starts a load, its peers hear of it this soon, not a heartbeat later.
ANNOUNCE_AFTER = 0.1


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
        self._reclaimer: asyncio.Task[None] | None = None
        self._announcing: set[asyncio.Task[None]] = set()
        self._warned_unsigned = False

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
        metrics = PlacementMetrics(registry)
        secret = settings.replica.hop_secret
        signer = HopSigner(
            secret.get_secret_value() if secret is not None else None,
            refused=lambda reason: metrics.hops_refused.labels(reason).inc(),
        )
        return cls(
            settings.replica,
            membership,
            manager,
            catalog,
            Forwarder(settings.replica, membership.id, signer),
            metrics,
            overhead_bytes=settings.manager.load_overhead_bytes,
        )

    def start(self) -> None:
        """Start giving back spare copies (see `release_spare_copies`) every heartbeat."""
        if self.settings.placement and self._reclaimer is None:
            self._reclaimer = asyncio.create_task(self._reclaim(), name="placement-reclaim")

    async def close(self) -> None:
        for task in self._announcing:
            task.cancel()
        if self._reclaimer is not None:
            await cancel_and_wait(self._reclaimer)
            self._reclaimer = None
        await self.forwarder.close()

    async def _reclaim(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval)
            try:
                self.release_spare_copies()
            except Exception:  # a bug: say so, keep serving
                log.exception("could not give back spare model copies")

    def release_spare_copies(self) -> list[tuple[str, int]]:
        """Move off this replica's devices the idle copies that rule 1 serves at a peer (a
        live peer with a smaller id holds it loaded) and that got no request for two
        heartbeats (the peers have seen the other copy by then). A copy left by a race
        would otherwise hold a slot that a model without any copy needs, and each load of
        that model would evict a model in use: a cascade that never settles."""
        if not self.active:
            return []
        quiet_for = 2 * self.settings.heartbeat_interval
        served_before_me: set[tuple[str, int]] = set()
        for row in self._live_peers():
            if row.id < self.id:
                served_before_me.update(
                    (m["name"], m["version"]) for m in row.models if m.get("state") == "loaded"
                )
        released = []
        for m in self.manager.status():
            key = (m.name, m.version)
            spare = key in served_before_me and m.state == "loaded"
            if not spare or m.last_used_s_ago <= quiet_for:
                continue
            if self.manager.release_copy(m.name, m.version, reason="placement"):
                log.info("%s@%d is served by a peer; its copy here is given back", *key)
                self.metrics.copies_released.inc()
                released.append(key)
        return released

    @property
    def id(self) -> str:
        return self.membership.id

    @property
    def signer(self) -> HopSigner:
        return self.forwarder.signer

    @property
    def active(self) -> bool:
        """Placement is on, this replica has live peers, and the secret to sign forwards."""
        if not self.settings.placement or not self._live_peers():
            return False
        if not self.signer.enabled:
            if not self._warned_unsigned:
                self._warned_unsigned = True
                log.warning("replica.placement is on and peers are live, but replica.hop_secret "
                            "is not set: every request is served here; set the same secret on "
                            "every replica to place them")  # fmt: skip
            return False
        return True

    # ---- decision ---------------------------------------------------------------------------
    def decide(self, route: Route) -> Decision:
        key = (route.name, route.version)
        models = self.manager.status()
        mine = next((m for m in models if (m.name, m.version) == key), None)
        rows = self._live_peers()
        spare = self._spare_bytes(key, models, rows)
        here = Replica(
            id=self.id,
            state=mine.state if mine is not None else None,
            free_bytes=max((d.free_bytes for d in self.manager.device_status()), default=0),
            spare_bytes=spare.get(self.id, 0),
        )
        peers = [_replica(row, key, spare.get(row.id, 0)) for row in rows]
        size = self._size(key, mine.predicted_bytes if mine else 0,
                          mine.measured_bytes if mine else 0, rows)  # fmt: skip
        return decide(here, peers, size, self.policy)

    def _spare_bytes(
        self, key: tuple[str, int], models: list[ModelStatus], rows: list[ReplicaView]
    ) -> dict[str, int]:
        """{replica id: bytes of its loaded, unpinned copies that rule 1 serves elsewhere}."""
        held: dict[str, dict[tuple[str, int], int]] = {self.id: {}}
        for m in models:
            if m.state == "loaded" and not m.pinned:
                held[self.id][(m.name, m.version)] = max(m.measured_bytes, m.predicted_bytes)
        for row in rows:
            held[row.id] = {
                (m["name"], m["version"]): int(m.get("bytes") or 0)
                for m in row.models
                if m.get("state") == "loaded" and not m.get("pinned")
            }
        holders: dict[tuple[str, int], list[str]] = {}
        for replica_id, copies in held.items():
            for model in copies:
                if model != key:
                    holders.setdefault(model, []).append(replica_id)
        return {
            replica_id: sum(held[replica_id][model] for model in copies)
            for replica_id, copies in spare_copies(holders).items()
        }

    def peer(self, replica_id: str) -> ReplicaView | None:
        """The live peer `replica_id`, as its last heartbeat shows it; None if not live."""
        return next((row for row in self._live_peers() if row.id == replica_id), None)

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
        peer holding it reports (resident, or parked warm: its footprint on a device), else
        the registered artifacts' size plus the load overhead. That last one is a floor (it
        leaves out what a backend reserves at run time, often most of a small model's
        charge): a version any replica ever loaded is sized by that replica's numbers, or
        every full replica would look like it had room for it."""
        if measured or predicted:
            return max(measured, predicted)
        for row in rows:
            for m in row.models:
                if not _is(m, key):
                    continue
                if m.get("state") in RESIDENT_STATES and m.get("bytes"):
                    return int(m["bytes"])
                if m.get("device_bytes"):
                    return int(m["device_bytes"])
        model = self.catalog.snapshot.models.get(key[0])
        version = model.versions.get(key[1]) if model is not None else None
        if version is None or not version.total_bytes:
            return None
        return version.total_bytes + self.overhead_bytes

    async def refresh(self) -> bool:
        """Write this replica's row and read its peers' now (one heartbeat), unless the view
        is fresher than REFRESH_AFTER; True when a new view was read. Loads are decided on
        it: a view a heartbeat old sends two replicas to load the same model, or one to
        restore a copy its holder has just evicted, and each such load evicts a model in use."""
        as_of = self.membership.peers_as_of
        if as_of is not None and self._clock() - as_of < REFRESH_AFTER:
            return False
        try:
            async with asyncio.timeout(REFRESH_TIMEOUT):
                return await self.membership.beat()
        except TimeoutError:
            return False

    def announce_soon(self) -> None:
        """Beat shortly after a load starts here, so peers see it loading and join it."""

        async def announce() -> None:
            await asyncio.sleep(ANNOUNCE_AFTER)
            await self.membership.beat()

        task = asyncio.create_task(announce(), name="placement-announce")
        self._announcing.add(task)
        task.add_done_callback(self._announcing.discard)

    # ---- forwarding -------------------------------------------------------------------------
    async def forward(
        self, decision: Decision, route: Route, scope: Scope, body: bytes, send: Send
    ) -> bool:
        """Try `decision.peers` in order (see the class contract)."""
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


def _replica(row: ReplicaView, key: tuple[str, int], spare_bytes: int) -> Replica:
    state = next((m.get("state") for m in row.models if _is(m, key)), None)
    if state not in RESIDENT_STATES | WARM_STATES:
        state = None  # evicting: on its way out, not worth sending a request after
    return Replica(
        id=row.id,
        state=state,
        free_bytes=max((int(d.get("free_bytes", 0)) for d in row.devices), default=0),
        queue_depth=row.queue_depth,
        address=row.address,
        spare_bytes=spare_bytes,
    )
