"""Loads model versions on demand and hands requests their backend.

`async with manager.acquire(name, version) as backend:` is the only path from a request to a
backend. A miss starts one load that every request for the model awaits; each request holds
a reference until it finishes, and an unload waits for those references to drop to zero.
A load that fails marks the model `failed` with the reason and is retried only after a
backoff; other models are unaffected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from backends.base import Backend
from hub.errors import Conflict, NotFound, Unavailable
from hub.manager.devices import Device
from hub.manager.loader import VersionLoader
from hub.manager.state import Entry, ModelKey, ModelState, ModelStatus
from hub.metrics import HubMetrics
from hub.settings import ManagerSettings

log = logging.getLogger(__name__)

FAILURE_BACKOFF_S = (1.0, 5.0, 30.0, 120.0)


class ModelManager:
    def __init__(
        self,
        settings: ManagerSettings,
        devices: list[Device],
        loader: VersionLoader,
        metrics: HubMetrics,
    ) -> None:
        self.settings = settings
        self.devices = devices
        self.loader = loader
        self.metrics = metrics
        self._entries: dict[ModelKey, Entry] = {}
        self._failures: dict[ModelKey, tuple[int, float]] = {}  # key -> (count, retry at)

    # ---- request path ---------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def acquire(
        self, name: str, version: int, kind: str = "", *, keep_alive: float | None = None
    ) -> AsyncIterator[Backend]:
        """Hold the loaded backend of `name`@`version` for one request. `keep_alive` (seconds;
        -1 forever, 0 unload after this request) overrides how long the model then stays
        resident, with Ollama's meaning."""
        entry = self._entry(ModelKey(name, version), kind)
        await self._ensure_loaded(entry)
        assert entry.backend is not None  # guaranteed by _ensure_loaded
        entry.in_flight += 1
        entry.idle.clear()
        try:
            yield entry.backend
        finally:
            entry.in_flight -= 1
            entry.last_used = time.monotonic()
            if entry.in_flight == 0:
                entry.idle.set()

    async def _ensure_loaded(self, entry: Entry) -> None:
        if entry.state is ModelState.LOADED and entry.backend is not None:
            return
        while entry.state is ModelState.EVICTING and entry.unload_task is not None:
            # Requests arriving during an unload wait for it, then load the model again.
            await asyncio.shield(entry.unload_task)
        if entry.waiting >= self.settings.max_waiting_per_model:
            raise Unavailable(
                f"{entry.key}: {entry.waiting} requests already wait for this model to load",
                retry_after=self.settings.retry_after,
                code="too_many_waiting",
            )
        entry.waiting += 1
        start = time.perf_counter()
        try:
            task = self._start_load(entry)
            await asyncio.wait_for(asyncio.shield(task), self.settings.load_timeout)
        except TimeoutError:
            raise Unavailable(
                f"{entry.key} did not finish loading within {self.settings.load_timeout:.0f}s",
                retry_after=self.settings.retry_after,
                code="load_timeout",
            ) from None
        finally:
            entry.waiting -= 1
            self.metrics.load_wait_seconds.observe(time.perf_counter() - start)
        if entry.state is ModelState.UNLOADED:
            raise Unavailable(
                entry.error or f"{entry.key} was unloaded", retry_after=self.settings.retry_after
            )
        if entry.state is not ModelState.LOADED:
            raise Unavailable(
                f"{entry.key} failed to load: {entry.error}",
                retry_after=self._retry_in(entry.key),
                code="load_failed",
            )

    def _start_load(self, entry: Entry) -> asyncio.Task[None]:
        if entry.load_task is not None and not entry.load_task.done():
            return entry.load_task
        count, retry_at = self._failures.get(entry.key, (0, 0.0))
        if count and time.monotonic() < retry_at:
            raise Unavailable(
                f"{entry.key} failed to load ({entry.error}); next attempt in "
                f"{retry_at - time.monotonic():.0f}s",
                retry_after=retry_at - time.monotonic(),
                code="load_failed",
            )
        entry.state = ModelState.LOADING
        entry.error = None
        entry.load_task = asyncio.create_task(self._load(entry), name=f"load {entry.key}")
        return entry.load_task

    async def _load(self, entry: Entry) -> None:
        start = time.perf_counter()
        device = self.devices[0].name
        try:
            prepared = await asyncio.to_thread(self.loader.prepare, entry.key)
            entry.kind = prepared.view.kind
            entry.predicted_bytes = await asyncio.to_thread(prepared.predict_memory)
            budget = self.devices[0].budget_bytes
            used = self.device_usage()[device]
            if entry.predicted_bytes > budget - used:
                raise Unavailable(
                    f"{entry.key} needs {entry.predicted_bytes} bytes but {device} has "
                    f"{budget - used} of {budget} free",
                    retry_after=self.settings.retry_after,
                    code="no_room",
                )
            backend = await asyncio.to_thread(self.loader.load, prepared, device, budget)
        except Unavailable as e:  # no room now: not the model's fault, no backoff
            entry.state = ModelState.UNLOADED
            entry.error = e.message
            return
        except Exception as e:
            count = self._failures.get(entry.key, (0, 0.0))[0] + 1
            delay = FAILURE_BACKOFF_S[min(count, len(FAILURE_BACKOFF_S)) - 1]
            self._failures[entry.key] = (count, time.monotonic() + delay)
            entry.state = ModelState.FAILED
            entry.error = f"{type(e).__name__}: {e}"
            self.metrics.loads.labels(*self._labels(entry), "failed", "cold").inc()
            log.error("loading %s failed (attempt %d, retry in %.0fs): %s",
                      entry.key, count, delay, entry.error)  # fmt: skip
            return
        self._failures.pop(entry.key, None)
        entry.backend = backend
        entry.device = device
        entry.measured_bytes = backend.memory_bytes()
        entry.state = ModelState.LOADED
        entry.loaded_at = time.monotonic()
        entry.idle.set()
        elapsed = time.perf_counter() - start
        self.metrics.loads.labels(*self._labels(entry), "ok", "cold").inc()
        self.metrics.load_seconds.labels("cold").observe(elapsed)
        self._update_gauges()

    def _retry_in(self, key: ModelKey) -> float:
        _, retry_at = self._failures.get(key, (0, 0.0))
        return max(1.0, retry_at - time.monotonic())

    # ---- admin ----------------------------------------------------------------------------
    async def load(self, name: str, version: int) -> ModelStatus:
        entry = self._entry(ModelKey(name, version), "")
        await self._ensure_loaded(entry)
        return self._status(entry)

    async def unload(self, name: str, version: int, *, reason: str = "admin") -> ModelStatus:
        """Unload once the requests in flight have finished; new requests reload it."""
        key = ModelKey(name, version)
        entry = self._entries.get(key)
        if entry is None or entry.state in (ModelState.UNLOADED, ModelState.FAILED):
            raise NotFound(f"{key} is not loaded")
        if entry.state is ModelState.LOADING and entry.load_task is not None:
            await asyncio.shield(entry.load_task)
        if entry.state is ModelState.EVICTING:
            raise Conflict(f"{key} is already being unloaded")
        entry.state = ModelState.EVICTING
        entry.unload_task = asyncio.create_task(self._drain_and_drop(entry, reason))
        await asyncio.shield(entry.unload_task)
        return self._status(entry)

    async def _drain_and_drop(self, entry: Entry, reason: str) -> None:
        await entry.idle.wait()
        await self._drop(entry, reason)

    async def _drop(self, entry: Entry, reason: str) -> None:
        backend, entry.backend = entry.backend, None
        if backend is not None:
            await backend.aclose()
            await asyncio.to_thread(backend.unload)
        entry.state = ModelState.UNLOADED
        entry.device = None
        entry.measured_bytes = 0
        self.metrics.evictions.labels(*self._labels(entry), reason).inc()
        self._update_gauges()

    def status(self) -> list[ModelStatus]:
        return [self._status(e) for _, e in sorted(self._entries.items())]

    def device_usage(self) -> dict[str, int]:
        used = {d.name: 0 for d in self.devices}
        for e in self._entries.values():
            if e.device is not None and e.state in (ModelState.LOADED, ModelState.EVICTING):
                used[e.device] = used.get(e.device, 0) + max(e.measured_bytes, e.predicted_bytes)
        return used

    async def close(self) -> None:
        for entry in list(self._entries.values()):
            if entry.load_task is not None and not entry.load_task.done():
                entry.load_task.cancel()
            if entry.backend is not None:
                with contextlib.suppress(Exception):
                    await self._drop(entry, "shutdown")

    # ---- helpers --------------------------------------------------------------------------
    def _entry(self, key: ModelKey, kind: str) -> Entry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = Entry(key=key, kind=kind)
            entry.idle.set()
        return entry

    @staticmethod
    def _labels(entry: Entry) -> tuple[str, str]:
        return entry.key.name, str(entry.key.version)

    def _status(self, e: Entry) -> ModelStatus:
        return ModelStatus(
            name=e.key.name,
            version=e.key.version,
            kind=e.kind,
            state=e.state.value,
            device=e.device,
            predicted_bytes=e.predicted_bytes,
            measured_bytes=e.measured_bytes,
            pinned=e.pinned,
            in_flight=e.in_flight,
            waiting=e.waiting,
            last_used_s_ago=round(time.monotonic() - e.last_used, 3),
            error=e.error,
        )

    def _update_gauges(self) -> None:
        counts: dict[str, int] = {d.name: 0 for d in self.devices}
        for e in self._entries.values():
            if e.device is not None and e.state is ModelState.LOADED:
                counts[e.device] = counts.get(e.device, 0) + 1
        for device, used in self.device_usage().items():
            self.metrics.resident_bytes.labels(device).set(used)
            self.metrics.loaded_models.labels(device).set(counts.get(device, 0))
