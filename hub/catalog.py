"""The hub's view of the registry: the latest snapshot of models, versions and aliases.

Requests resolve model names against this in-memory snapshot instead of asking SQL and MLflow
each time. The reconciler refreshes it every `registry.poll_interval` seconds and at once after an
alias move (the hub's own or MLflow's webhook), so moves are followed without a restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from backends.workers import WorkerPool
from hub.errors import NotFound
from registry.service import Registry
from registry.views import ModelView, RegistrySnapshot

log = logging.getLogger(__name__)

Listener = Callable[[RegistrySnapshot, RegistrySnapshot], Awaitable[None]]


class Catalog:
    """The latest registry snapshot this hub serves from, and who to tell when it changes.

    Contract: `snapshot` is always a complete, immutable snapshot (never a half-refreshed
    one); `refresh()` replaces it (refreshes never overlap) and then awaits each listener
    with (old, new) when it changed; a failing listener is logged and does not stop the
    others. `model(name)` raises NotFound naming the known models.
    """

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._snapshot = RegistrySnapshot(models={})
        self._listeners: list[Listener] = []
        self._refresh_lock = asyncio.Lock()
        # Snapshots are read on a thread of their own (refreshes never overlap), never
        # behind other blocking work (backends/workers.py).
        self._threads = WorkerPool("catalog", 1)

    @property
    def snapshot(self) -> RegistrySnapshot:
        return self._snapshot

    def on_change(self, listener: Listener) -> None:
        """Call `listener(old, new)` after every refresh that changed the snapshot."""
        self._listeners.append(listener)

    async def refresh(self) -> RegistrySnapshot:
        async with self._refresh_lock:
            new = await self._threads.run(self.registry.snapshot)
            old = self._snapshot
            if new == old:
                return old  # the same object: what was decided from it still holds
            self._snapshot = new
        for listener in self._listeners:
            try:
                await listener(old, new)
            except Exception:
                log.exception("registry change listener failed")
        return new

    def close(self) -> None:
        self._threads.close()

    def model(self, name: str) -> ModelView:
        model = self._snapshot.models.get(name)
        if model is None:
            known = ", ".join(self._snapshot.names()) or "none"
            raise NotFound(
                f"model {name!r} does not exist (known models: {known})",
                param="model",
                code="model_not_found",
            )
        return model
