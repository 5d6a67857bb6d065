"""The hub's view of the registry: the latest snapshot of models, versions and aliases.

Requests resolve model names against this in-memory snapshot instead of asking SQL and MLflow
each time. It is refreshed every `registry.poll_interval` seconds and at once after the hub
itself changes the registry, so alias moves are followed without a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from hub.errors import NotFound
from registry.service import Registry
from registry.views import ModelView, RegistrySnapshot

log = logging.getLogger(__name__)

Listener = Callable[[RegistrySnapshot, RegistrySnapshot], Awaitable[None]]


class Catalog:
    def __init__(self, registry: Registry, poll_interval: float) -> None:
        self.registry = registry
        self.poll_interval = poll_interval
        self._snapshot = RegistrySnapshot(models={})
        self._task: asyncio.Task[None] | None = None
        self._listeners: list[Listener] = []
        self._refresh_lock = asyncio.Lock()
        self.last_error: str | None = None

    @property
    def snapshot(self) -> RegistrySnapshot:
        return self._snapshot

    def on_change(self, listener: Listener) -> None:
        """Call `listener(old, new)` after every refresh that changed the snapshot."""
        self._listeners.append(listener)

    async def refresh(self) -> RegistrySnapshot:
        async with self._refresh_lock:
            new = await asyncio.to_thread(self.registry.snapshot)
            old, self._snapshot = self._snapshot, new
            self.last_error = None
        if new != old:
            for listener in self._listeners:
                try:
                    await listener(old, new)
                except Exception:
                    log.exception("registry change listener failed")
        return new

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

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._poll(), name="registry-poll")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                await self.refresh()
            except Exception as e:  # keep serving the last good snapshot
                self.last_error = str(e)
                log.warning("registry refresh failed: %s", e)
