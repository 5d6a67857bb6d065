"""What the manager knows about each model version it has touched."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from backends.base import Backend


class ModelState(enum.StrEnum):
    LOADING = "loading"
    LOADED = "loaded"
    WARM = "warm"  # weights parked in host memory, restorable by a copy
    EVICTING = "evicting"
    FAILED = "failed"
    UNLOADED = "unloaded"


@dataclass(frozen=True, order=True)
class ModelKey:
    name: str
    version: int

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass
class Entry:
    """Mutable bookkeeping for one model version; touched only on the event loop."""

    key: ModelKey
    kind: str
    state: ModelState = ModelState.UNLOADED
    backend: Backend | None = None
    device: str | None = None
    predicted_bytes: int = 0
    measured_bytes: int = 0
    in_flight: int = 0
    waiting: int = 0
    pinned: bool = False
    last_used: float = field(default_factory=time.monotonic)
    loaded_at: float | None = None
    error: str | None = None
    # The one load in progress; every request for this model awaits the same task.
    load_task: asyncio.Task[None] | None = None
    # The unload in progress (waiting for in-flight requests, then dropping the weights).
    unload_task: asyncio.Task[None] | None = None
    # Set whenever in_flight drops to zero, so an unload can wait for requests to finish.
    idle: asyncio.Event = field(default_factory=asyncio.Event)


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
