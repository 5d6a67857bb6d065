"""Loads waiting for device memory, and the pump that grants it.

A load asks for room (`request`) and awaits its `granted` future. `pump()` runs, on the event
loop and without awaiting, whenever room may have appeared (an eviction finished, a request
released a model, a keep-alive ran out, a pin was lifted, a model passed its minimum
residency). It walks the requests first come, first served: a request that fits in free
memory is charged to the ledger and granted at once; one that needs evictions gets victims
chosen by the placement and the policy, and is bound to that device until they are gone.

Memory being freed for a request is kept for it: while its victims are leaving, later
requests see the device's free memory minus what the earlier one still lacks, so nobody
takes the room another request is evicting for. A request that cannot be helped now (its
only candidates are busy, pinned or too young) waits without holding anything, so smaller
requests behind it still proceed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from hub.manager.planning.eviction import Candidate, EvictionPolicy
from hub.manager.planning.keys import ModelKey
from hub.manager.planning.ledger import MemoryLedger
from hub.manager.planning.placement import place
from hub.manager.planning.pressure import NoRoom


@dataclass(eq=False)
class RoomRequest:
    """One load's pending request for device memory; `granted` resolves to the device once
    the bytes are charged to it in the ledger."""

    key: ModelKey
    # Bytes it needs on each device it may go to.
    need: Mapping[str, int]
    # Devices it may go to, and the one it prefers (where its warm copy came from).
    devices: tuple[str, ...]
    prefer: str | None
    granted: asyncio.Future[str]
    # Set once evictions were started for it: it waits for room on this device only.
    device: str | None = None
    # Models being evicted to make its room.
    victims: set[ModelKey] = field(default_factory=set)
    since: float = field(default_factory=time.monotonic)


class RoomBroker:
    """The queue of room requests and the pump that grants them, first come, first served."""

    def __init__(self, ledger: MemoryLedger, policy: EvictionPolicy) -> None:
        self.ledger = ledger
        self.policy = policy
        self._pending: list[RoomRequest] = []
        # Devices that stopped computing (device -> why): never granted again.
        self.lost: dict[str, str] = {}

    @property
    def pending(self) -> list[RoomRequest]:
        return [r for r in self._pending if not r.granted.done()]

    def request(
        self, key: ModelKey, need: Mapping[str, int], prefer: str | None = None
    ) -> RoomRequest:
        """Ask for `need[device]` bytes on one of `need`'s devices."""
        granted: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        req = RoomRequest(key, dict(need), tuple(need), prefer, granted)
        self._pending.append(req)
        return req

    def withdraw(self, req: RoomRequest) -> None:
        """Stop waiting; room granted at the last moment goes back to the ledger."""
        if req in self._pending:
            self._pending.remove(req)
        if req.granted.done() and not req.granted.cancelled():
            self.ledger.release(req.key)
        else:
            req.granted.cancel()

    def abandon(self, req: RoomRequest, error: BaseException) -> None:
        """Stop looking for room for `req`: its awaiter gets `error` (nobody waits for the
        load any more)."""
        if req in self._pending:
            self._pending.remove(req)
        if not req.granted.done():
            req.granted.set_exception(error)

    def cancel_all(self) -> None:
        for req in self._pending:
            req.granted.cancel()
        self._pending.clear()

    def pump(
        self,
        candidates: Callable[[str], list[Candidate]],
        leaving: Callable[[ModelKey], bool],
    ) -> list[tuple[ModelKey, str]]:
        """Grant what fits and choose victims for the rest; returns the (victim, device)
        evictions the caller must start now, before awaiting anything. `candidates(device)`
        lists what may be evicted there, `leaving(key)` says whether an eviction is still
        under way."""
        free = {d: self.ledger.free(d) for d in self.ledger.devices}
        chosen: set[ModelKey] = set()
        evictions: list[tuple[ModelKey, str]] = []

        def available(device: str) -> list[Candidate]:
            return [c for c in candidates(device) if c.key not in chosen]

        for req in list(self._pending):
            if req.granted.done():
                self._pending.remove(req)
                continue
            # Victims still leaving bring their bytes to this request when they are gone.
            req.victims = {k for k in req.victims if leaving(k)}
            incoming = sum(self.ledger.charge_of(k) for k in req.victims)
            devices = tuple(
                d
                for d in ((req.device,) if req.device is not None else req.devices)
                if d not in self.lost
            )
            if not devices:
                self._pending.remove(req)
                why = "; ".join(f"device {d} is lost ({self.lost[d]})" for d in req.devices
                                if d in self.lost)  # fmt: skip
                req.granted.set_exception(NoRoom(why, code="device_lost"))
                continue
            view = dict(free)
            if req.device is not None:
                view[req.device] += incoming
            plan = place(req.need, devices, view, available, self.policy, prefer=req.prefer)
            if plan is None:
                continue
            device = plan.device
            need = req.need[device]
            if not plan.victims and free[device] >= need:
                self.ledger.reserve(req.key, device, need)
                free[device] -= need
                self._pending.remove(req)
                req.granted.set_result(device)
                continue
            req.device = device
            for victim in plan.victims:
                chosen.add(victim.key)
                req.victims.add(victim.key)
                evictions.append((victim.key, device))
            # The victims bring their bytes later; what they do not cover comes out of the
            # memory free now, kept from the requests behind this one.
            coming = incoming + sum(v.nbytes for v in plan.victims)
            free[device] -= max(0, need - coming)
        return evictions
