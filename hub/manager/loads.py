"""Bringing a model onto a device: a cold load from the verified cache or a warm restore.

A cold load materialises the version (verified local copy), resolves its deployment, predicts
its footprint; a warm restore reuses what was measured before. Either way the load then asks
the room broker for that many bytes and waits (up to the load timeout) until they are charged
to it on a device, loads or restores in a worker thread while measuring, and settles the
ledger to the larger of prediction and measurement, waiting for more room if the model came
out larger than predicted. Outcomes: LOADED; back to WARM/UNLOADED with the reason when no
room could be made (no backoff: not the model's fault); FAILED with a backoff otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import time

from hub.errors import Unavailable
from hub.manager.deployment import Deployment
from hub.manager.evicting import Evicting
from hub.manager.loader import PreparedVersion
from hub.manager.pressure import NoRoom, feasibility
from hub.manager.state import Entry, ModelState

log = logging.getLogger(__name__)

FAILURE_BACKOFF_S = (1.0, 5.0, 30.0, 120.0)


class Loading(Evicting):
    async def _load(self, entry: Entry) -> Unavailable | None:
        """Bring `entry` onto a device; returns the error its waiters should raise, if any."""
        warm = entry.backend is not None and entry.key in self.host_tier
        source = "warm" if warm else "cold"
        prepared: PreparedVersion | None = None
        try:
            if warm:
                self.host_tier.hold(entry.key)
                # Restored as it was (KV cache included): the same bytes on any device.
                size = max(entry.predicted_bytes, entry.measured_bytes)
                need = dict.fromkeys(self._devices_for(entry), size)
                prep_s = 0.0
            else:
                start = time.perf_counter()
                prepared = await asyncio.to_thread(self.loader.prepare, entry.key)
                entry.kind = prepared.view.kind
                entry.deployment = Deployment.resolve(
                    prepared.view.runtime_config, self._specs.get(entry.key.name), self._budgets
                )
                budgets = {d: self._budgets[d] for d in self._devices_for(entry)}
                need = await asyncio.to_thread(self.footprint.predict, prepared, budgets)
                entry.predicted_bytes = max(need.values())
                prep_s = time.perf_counter() - start
            device = entry.device = await self._claim_room(entry, need)
            if not warm:
                entry.predicted_bytes = need[device]
            start = time.perf_counter()
            if prepared is not None:
                backend, measured = await asyncio.to_thread(
                    self.footprint.load, self.loader, prepared, device, self._budgets[device]
                )
            else:
                assert entry.backend is not None
                backend = entry.backend
                measured = await asyncio.to_thread(self.footprint.restore, backend, device)
                self.host_tier.remove(entry.key)
                entry.host_bytes = 0
            load_s = time.perf_counter() - start + prep_s
        except NoRoom as e:
            return self._load_refused(entry, e, warm)
        except asyncio.CancelledError:
            self.ledger.release(entry.key)
            self.host_tier.unhold(entry.key)
            entry.device = None
            raise
        except Exception as e:
            return await self._load_failed(entry, e, source)
        entry.backend = backend
        entry.measured_bytes = measured
        if not warm:
            what = f"{entry.key} on {device}"
            self.footprint.check_prediction(what, entry.predicted_bytes, measured)
        try:
            await self._settle(entry, max(entry.predicted_bytes, measured))
        except NoRoom as e:
            # It loaded larger than predicted and no room could be made for the difference.
            await self._drop(entry, "overflow")
            e.message += "; it measured more than predicted: raise manager.load_overhead_bytes"
            return self._load_refused(entry, e, warm=False)
        self._loaded(entry, device, source, load_s)
        return None

    def _devices_for(self, entry: Entry) -> list[str]:
        """The devices `entry` may go to: the one its deployment names, else all."""
        assert entry.deployment is not None
        return [entry.deployment.device] if entry.deployment.device else list(self._budgets)

    async def _claim_room(self, entry: Entry, need: dict[str, int]) -> str:
        """Wait until `need[device]` bytes are charged to `entry` on some device; returns the
        device.

        There is no deadline of its own: it waits as long as some request (or admin call)
        still waits for this load, each with its own timeout; when the last one gives up,
        `_wait_for_load` abandons the request and this raises NoRoom."""
        feasibility(self, entry, need)  # raises NoRoom when waiting cannot help
        prefer = entry.last_device if entry.key in self.host_tier else None
        return await self._wait_for_room(entry, need, prefer)

    async def _wait_for_room(
        self, entry: Entry, need: dict[str, int], prefer: str | None = None
    ) -> str:
        req = self._broker.request(entry.key, need, prefer)
        entry.room = req
        try:
            self._pump()
            return await req.granted
        except asyncio.CancelledError:
            self._broker.withdraw(req)
            raise
        finally:
            entry.room = None

    async def _settle(self, entry: Entry, charge: int) -> None:
        """Make `entry`'s ledger charge exactly `charge`, waiting for room if it grew (it
        loaded larger than predicted)."""
        extra = charge - self.ledger.charge_of(entry.key)
        if extra <= 0:
            self.ledger.shrink(entry.key, charge)
            return
        device = self.ledger.device_of(entry.key)
        assert device is not None
        await self._wait_for_room(entry, {device: extra})

    def _loaded(self, entry: Entry, device: str, source: str, load_s: float) -> None:
        entry.device = entry.last_device = device
        entry.state = ModelState.LOADED
        entry.loaded_at = time.monotonic()
        entry.hits = 0
        entry.error = None
        if source == "warm":
            entry.warm_load_s = load_s
        else:
            entry.cold_load_s = load_s
        assert entry.deployment is not None
        entry.pinned = entry.pinned or entry.deployment.pin
        self._failures.pop(entry.key, None)
        self.policy.on_access(self._candidate(entry))
        self.metrics.loads.labels(*self._labels(entry), "ok", source).inc()
        self.metrics.load_seconds.labels(source).observe(load_s)
        log.info("%s %s onto %s in %.2fs (%d bytes)", entry.key,
                 "restored" if source == "warm" else "loaded", device, load_s,
                 self.ledger.charge_of(entry.key))  # fmt: skip
        self._update_gauges()
        if entry.waiting == 0 and entry.in_flight == 0:
            self._arm_keep_alive(entry)

    def _load_refused(self, entry: Entry, e: NoRoom, warm: bool) -> Unavailable:
        """No room now: not the model's fault, so no backoff; a warm copy stays parked."""
        self.ledger.release(entry.key)
        self.host_tier.unhold(entry.key)
        entry.device = None
        entry.state = ModelState.WARM if warm and entry.backend is not None else ModelState.UNLOADED
        entry.error = e.message
        self.metrics.loads.labels(*self._labels(entry), "no_room", "warm" if warm else "cold").inc()
        log.warning("%s", e.message)
        return Unavailable(e.message, retry_after=self.settings.retry_after, code=e.code)

    async def _load_failed(self, entry: Entry, e: Exception, source: str) -> Unavailable:
        self.ledger.release(entry.key)
        count = self._failures.get(entry.key, (0, 0.0))[0] + 1
        delay = FAILURE_BACKOFF_S[min(count, len(FAILURE_BACKOFF_S)) - 1]
        self._failures[entry.key] = (count, time.monotonic() + delay)
        # A failed restore leaves the parked copy in an unknown state: drop it, reload cold.
        await self._drop(entry, "failed")
        entry.device = None
        entry.state = ModelState.FAILED
        entry.error = f"{type(e).__name__}: {e}"
        self.metrics.loads.labels(*self._labels(entry), "failed", source).inc()
        log.error("loading %s failed (attempt %d, retry in %.0fs): %s",
                  entry.key, count, delay, entry.error)  # fmt: skip
        return Unavailable(
            f"{entry.key} failed to load: {entry.error}", retry_after=delay, code="load_failed"
        )
