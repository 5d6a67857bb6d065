"""The planner: every decision about device and host memory, none of the doing.

`Planner` composes the ledger, the host tier, the eviction policy and the room broker over a
read-only view of the models (`occupants`, the manager's entries). It answers what may be
evicted (`candidates`), grants room and picks victims (`pump`, returning the evictions the
caller must start), refuses loads that waiting cannot help (`check_feasible`), and explains
who holds the memory (`explain`). It never awaits, loads or frees anything, so it is tested
directly, with plain objects and an injected clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from hub.manager.planning.dependents import riding
from hub.manager.planning.eviction import Candidate, EvictionPolicy, make_policy
from hub.manager.planning.host_tier import HostTier
from hub.manager.planning.keys import ModelKey
from hub.manager.planning.ledger import MemoryLedger
from hub.manager.planning.occupants import Occupant, evictable, idle_loaded
from hub.manager.planning.pressure import NoRoom, check_feasible, describe_room
from hub.manager.planning.room import RoomBroker, RoomRequest
from hub.manager.residency import ModelState


class Planner:
    """Decisions over device budgets (bytes per device) and a host tier (bytes)."""

    def __init__(
        self,
        budgets: Mapping[str, int],
        occupants: Mapping[ModelKey, Occupant],
        *,
        host_budget: int = 0,
        policy: str | EvictionPolicy = "gdsf",
        min_residency: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.budgets = dict(budgets)
        self.ledger = MemoryLedger(budgets)
        self.host_tier = HostTier(host_budget)
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.broker = RoomBroker(self.ledger, self.policy)
        # Devices that stopped computing, and why: nothing is placed on them again.
        self.lost: dict[str, str] = self.broker.lost
        self.min_residency = min_residency
        self._occupants = occupants
        self._clock = clock

    # ---- eviction -------------------------------------------------------------------------
    def candidate(self, o: Occupant) -> Candidate:
        """`o` as the eviction policy sees it."""
        nbytes = self.ledger.charge_of(o.key)
        # Coming back is a restore if the host tier can take its weights, else a cold load.
        warm = o.warm_load_s if self.host_tier.admits(nbytes) else None
        return Candidate(
            key=o.key,
            device=self.ledger.device_of(o.key) or "",
            nbytes=nbytes,
            last_used=o.last_used,
            reload_s=warm or o.cold_load_s or 1.0,
            hits=o.hits,
            base=o.base,
        )

    def candidates(self, device: str) -> list[Candidate]:
        """Models on `device` that may be evicted now (see `occupants.evictable`)."""
        now = self._clock()
        out = []
        for key in self.ledger.charges(device):
            o = self._occupants.get(key)
            if (
                o is not None
                and evictable(o, now, self.min_residency)
                and self._free_of_riders(key, now)
            ):
                out.append(self.candidate(o))
        return out

    def _free_of_riders(self, key: ModelKey, now: float) -> bool:
        """A base may go only with its adapters: when every adapter on it may go too."""
        return all(
            evictable(self._occupants[k], now, self.min_residency)
            for k in riding(key, self._occupants)
        )

    def adapters_on(self, key: ModelKey) -> list[ModelKey]:
        """The adapters of base `key` on its device now (they keep it resident)."""
        return riding(key, self._occupants)

    def record_use(self, key: ModelKey) -> None:
        """A request used `key` (or it was just loaded): tell the policy."""
        self.policy.on_access(self.candidate(self._occupants[key]))

    def lose_device(self, device: str, reason: str) -> None:
        """Place nothing on `device` from now on; loads waiting for room only there are
        refused (NoRoom `device_lost`) at the next pump."""
        self.lost[device] = reason

    def usable(self, devices: list[str]) -> list[str]:
        """`devices` less the lost ones; NoRoom (`device_lost`) naming them when none is left."""
        left = [d for d in devices if d not in self.lost]
        if devices and not left:
            why = "; ".join(f"device {d} is lost ({self.lost[d]})" for d in devices)
            raise NoRoom(f"{why}: nothing can be placed there until the hub restarts",
                         code="device_lost")  # fmt: skip
        return left

    # ---- room -----------------------------------------------------------------------------
    def request_room(
        self, key: ModelKey, need: Mapping[str, int], prefer: str | None = None
    ) -> RoomRequest:
        """Queue a request for `need[device]` bytes on one of its devices (see `pump`)."""
        return self.broker.request(key, need, prefer)

    def pump(self) -> list[tuple[ModelKey, str]]:
        """Grant what fits now; returns the (victim, device) evictions to start right away,
        each victim evictable and not already leaving."""
        return self.broker.pump(self.candidates, self._leaving)

    def _leaving(self, key: ModelKey) -> bool:
        o = self._occupants.get(key)
        return o is not None and o.state is ModelState.EVICTING

    def next_eligible(self) -> float | None:
        """While loads wait for room: when the next idle, unpinned model passes the minimum
        residency (clock time), so the pump can run again then; None otherwise."""
        if not self.broker.pending:
            return None
        now = self._clock()
        times = [
            o.loaded_at + self.min_residency
            for o in self._occupants.values()
            if idle_loaded(o) and not o.pinned and o.loaded_at is not None
        ]
        future = [t for t in times if t > now]
        return min(future) if future else None

    # ---- explanations ---------------------------------------------------------------------
    def check_feasible(self, key: ModelKey, need: Mapping[str, int]) -> None:
        """Raise `NoRoom` (`too_large`, `pinned_full`) when waiting for room cannot help."""
        check_feasible(key, need, self.ledger, self._occupants)

    def explain(self, request: RoomRequest | None) -> str:
        """What a waiting load needs and who holds the memory ('' when not waiting)."""
        return describe_room(
            request,
            self.ledger,
            self._occupants,
            now=self._clock(),
            min_residency=self.min_residency,
        )
