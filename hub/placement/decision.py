"""Where one request for a model version is served: here, or at a peer replica.

Pure policy (no I/O, no clock, no torch, SQL or Prometheus): the inputs are what this replica
holds and the room it has, and what each live peer said in its last heartbeat; the output is
the ordered list of peers to try (empty: serve here) and why.

The rules, in order (KServe ModelMesh's idea: send a request where its model already is):

1. **Resident somewhere.** Among the replicas holding the version on a device (loaded, or
   loading: the load is under way) with capacity, this one included, the one with the
   smallest id serves (a loaded copy before one still loading). Every replica agrees on
   that choice without talking, so when a race left two copies, one stops getting traffic
   (and rule 3 reclaims it), instead of both staying hot and crowding out a third model.
2. **Warm where it fits** (weights parked in host memory: a restore, not a cold load):
   here if held warm here with room for it; else the warm peer with room (smallest id).
3. **Room somewhere.** Load here when it fits without evicting (or its size is unknown);
   else forward to the peer with the most room where it fits (it loads it). Room is free
   memory plus spare copies: models a replica holds that rule 1 serves at another replica.
   A warm copy on a full replica does not count: restoring it there would evict a model
   in use and start a cascade, while a replica with room holds one more model for good.
4. **No room anywhere.** Something is evicted: restore the warm copy (here, else at the
   warm peer), else load here.

A peer has capacity when its queue depth (requests in flight plus waiting for a load) is
under `max_queue_depth`. The peers after the first in `peers` are fall-backs for when the
first refuses the connection (it just died); after them the request is served here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

K = TypeVar("K")  # whatever names a model version

# A version's state on a replica, as heartbeats and the manager's status name it.
RESIDENT_STATES = frozenset({"loaded", "loading"})
WARM_STATES = frozenset({"warm"})

Reason = Literal[
    "resident_here",  # rule 1, this replica
    "resident_peer",  # rule 1, a peer
    "warm_here",  # rule 2 (or 4: restored here, evicting)
    "warm_peer",  # rule 2 (or 4)
    "fits_here",  # rule 3: load here, nothing evicted
    "room_peer",  # rule 3: a peer loads it without evicting
    "evict_here",  # rule 4: nobody has room or a warm copy; load here, evicting
]


@dataclass(frozen=True)
class Replica:
    """One replica as placement sees it: what state the requested version is in there
    (None: not held), its largest free room on one device, its spare bytes (copies of other
    models that another replica serves instead, see `spare_copies`), and its queue depth."""

    id: str
    state: str | None
    free_bytes: int
    queue_depth: int = 0
    address: str = ""
    spare_bytes: int = 0

    @property
    def room(self) -> int:
        """What a load may take here without evicting a model in use."""
        return self.free_bytes + self.spare_bytes


@dataclass(frozen=True)
class PlacementPolicy:
    """`max_queue_depth`: a peer at or past this many queued requests takes no forwards."""

    max_queue_depth: int = 32


@dataclass(frozen=True)
class Decision:
    """`peers`: where to forward, in order of preference (empty: serve here); `reason`: which
    rule decided (a metric label); `avoids_load`: serving at `peers[0]` spares this replica a
    load or restore (its copy is already there)."""

    peers: tuple[Replica, ...]
    reason: Reason
    avoids_load: bool = False

    @property
    def here(self) -> bool:
        return not self.peers

    @property
    def loads(self) -> bool:
        """Whether it starts a load or a restore somewhere (no copy is resident yet)."""
        return self.reason not in ("resident_here", "resident_peer")


def decide(
    here: Replica,
    peers: Sequence[Replica],
    size_bytes: int | None,
    policy: PlacementPolicy,
) -> Decision:
    """Decide for one request; `size_bytes` is the version's expected footprint (None when
    nobody knows it yet). `peers` are the live peers other than `here`; whoever the caller
    knows to be down is left out."""
    able = [p for p in peers if p.id != here.id and p.queue_depth < policy.max_queue_depth]

    resident = sorted((p for p in able if p.state in RESIDENT_STATES), key=_holder_rank)
    if here.state in RESIDENT_STATES:
        ahead = tuple(p for p in resident if _holder_rank(p) < _holder_rank(here))
        return Decision(ahead, "resident_peer" if ahead else "resident_here")
    if resident:
        return Decision(_fallbacks(resident, able), "resident_peer", avoids_load=True)

    # Rule 2: a warm copy is restored where that evicts nothing.
    def fits(replica: Replica) -> bool:
        return size_bytes is None or replica.room >= size_bytes

    warm = sorted((p for p in able if p.state in WARM_STATES), key=_by_id)
    if here.state in WARM_STATES and fits(here):
        return Decision((), "warm_here")
    warm_with_room = [p for p in warm if fits(p)]
    if warm_with_room:
        return Decision(_fallbacks(warm_with_room, able), "warm_peer", avoids_load=True)

    # Rule 3: a load (or a restore) that evicts nothing, here first.
    if fits(here):
        return Decision((), "fits_here")
    roomy = sorted((p for p in able if fits(p)), key=lambda p: (-p.room, p.id))
    if roomy:
        return Decision(tuple(roomy), "room_peer")
    # Nobody has room: something is evicted; a warm copy at least spares the cold load.
    if here.state in WARM_STATES:
        return Decision((), "warm_here")
    if warm:
        return Decision(_fallbacks(warm, able), "warm_peer", avoids_load=True)
    return Decision((), "evict_here")


def spare_copies(holders: Mapping[K, Sequence[str]]) -> dict[str, list[K]]:
    """{replica id: the models it holds that rule 1 serves elsewhere}, from {model: ids of
    the replicas holding it loaded}: every copy but the one with the smallest id. Such a copy
    gets no traffic, so evicting it costs nothing; counting its bytes as room lets a load go
    there instead of evicting a model in use somewhere (a race's duplicate gets reclaimed)."""
    spare: dict[str, list[K]] = {}
    for model, ids in holders.items():
        for replica_id in sorted(ids)[1:]:
            spare.setdefault(replica_id, []).append(model)
    return spare


def _by_id(replica: Replica) -> str:
    return replica.id


def _holder_rank(replica: Replica) -> tuple[bool, str]:
    # Loaded before loading (a request sent to a load in progress waits for it), then by id.
    return (replica.state != "loaded", replica.id)


def _fallbacks(first: list[Replica], able: list[Replica]) -> tuple[Replica, ...]:
    """`first`, then the warm holders not already in it: if the preferred holders refuse
    the connection, a warm copy still beats a cold load here."""
    seen = {p.id for p in first}
    warm = sorted((p for p in able if p.state in WARM_STATES and p.id not in seen), key=_by_id)
    return (*first, *warm)
