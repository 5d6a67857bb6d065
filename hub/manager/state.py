"""What the manager knows about each model version it has touched, and the rows it reports.

An `Entry` changes state only through `Entry.move`, which checks the residency table
(`hub.manager.residency`); it satisfies the planner's read-only `Occupant` view as it is.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hub.errors import Unavailable
from hub.manager.keep_alive import effective_keep_alive
from hub.manager.planning.keys import ModelKey
from hub.manager.residency import ModelState, check_transition

if TYPE_CHECKING:
    from backends.base import Backend
    from hub.manager.deployment import Deployment
    from hub.manager.planning.room import RoomRequest

__all__ = ["DeviceStatus", "Entry", "HostTierStatus", "ModelKey", "ModelState", "ModelStatus"]


@dataclass
class Entry:
    """Mutable bookkeeping for one model version; touched only on the event loop. Its
    `state` is read-only: `move` is the one way to change it."""

    key: ModelKey
    kind: str
    _state: ModelState = field(default=ModelState.UNLOADED, repr=False)
    # Present while LOADED, EVICTING and WARM (then holding parked weights).
    backend: Backend | None = None
    # The device it is placed on while LOADING (once room is granted), LOADED and EVICTING.
    device: str | None = None
    # The device it was on last; a warm restore goes back there when it can.
    last_device: str | None = None
    # Placement, keep-alive and pin from the settings and the version's runtime config.
    deployment: Deployment | None = None
    # A LoRA adapter's base model version, known once the version was prepared: its
    # requests run on the base's engine, so the base stays resident while it is (see
    # `planning.dependents`). None for a full model.
    base: ModelKey | None = None
    # The base's backend the adapter's backend was attached to (its parked copy lives there).
    attached_to: Backend | None = None
    predicted_bytes: int = 0
    measured_bytes: int = 0
    # Bytes its parked weights take in the host tier while WARM.
    host_bytes: int = 0
    in_flight: int = 0
    # Requests (and admin calls) waiting for this model to load.
    waiting: int = 0
    pinned: bool = False
    # The keep-alive the last request asked for (Ollama: each request sets it); None: default.
    keep_alive: float | None = None
    # When the keep-alive runs out (monotonic); None while busy, pinned or kept forever.
    expires_at: float | None = None
    last_used: float = field(default_factory=time.monotonic)
    loaded_at: float | None = None
    # Requests served since it was last loaded; the eviction policy's frequency.
    hits: int = 0
    # Measured seconds of its last cold load and warm restore: its reload cost.
    cold_load_s: float | None = None
    warm_load_s: float | None = None
    error: str | None = None
    # The one load in progress; every request for this model awaits the same task, which
    # returns the error to raise, or None once the model is LOADED.
    load_task: asyncio.Task[Unavailable | None] | None = None
    # The eviction in progress (waiting for in-flight requests, then offloading or dropping).
    evict_task: asyncio.Task[None] | None = None
    # The load's pending request for device memory, while it waits for room.
    room: RoomRequest | None = None
    # Set whenever in_flight drops to zero, so an unload can wait for requests to finish.
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def state(self) -> ModelState:
        return self._state

    def move(self, to: ModelState) -> None:
        """Change state; raises InvalidTransition on a move the residency table forbids."""
        self._state = check_transition(self.key, self._state, to)

    def keep_alive_s(self, default: float) -> float:
        """The keep-alive in force: this model's last request's, its deployment's, or
        `default` (the manager's); -1 means forever."""
        deployment = self.deployment.keep_alive if self.deployment else None
        return effective_keep_alive(self.keep_alive, deployment, default)


@dataclass(frozen=True)
class ModelStatus:
    """A read-only row of `/admin/models`."""

    name: str
    version: int
    kind: str
    state: str
    device: str | None
    predicted_bytes: int
    measured_bytes: int
    pinned: bool
    in_flight: int
    waiting: int
    last_used_s_ago: float
    error: str | None
    # Bytes held in the host tier (state warm).
    host_bytes: int = 0
    # The keep-alive in force (seconds; -1 forever) and when it runs out (None: not running).
    keep_alive_s: float = 0.0
    keep_alive_expires_in_s: float | None = None
    last_device: str | None = None
    cold_load_s: float | None = None
    warm_load_s: float | None = None
    # A LoRA adapter's base (`name@version`); on a base, its adapters on the device now.
    base: str | None = None
    adapters: tuple[str, ...] = ()
    # Processes besides the hub's that run the model's compute (CPU encoders' workers).
    worker_pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class DeviceStatus:
    """A read-only row of `/admin/devices`."""

    name: str
    budget_bytes: int
    used_bytes: int
    free_bytes: int
    pinned_bytes: int
    models: int
    # Bytes of the budget the device itself holds (a CUDA context), within `used_bytes`.
    context_bytes: int = 0
    # False once a probe found the device not computing; `error` says how.
    usable: bool = True
    error: str | None = None


@dataclass(frozen=True)
class HostTierStatus:
    """The warm tier: evicted weights parked in host memory."""

    budget_bytes: int
    used_bytes: int
    free_bytes: int
    models: int
    pinned_memory: bool
