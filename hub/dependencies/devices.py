"""Whether each configured accelerator still computes, kept by a background probe.

A CUDA context that crashed (an illegal memory access, a GPU fallen off the bus) leaves a
process that still answers HTTP while every request on that device fails or hangs: a server
that returns 200 with a dead context is worse than one that is down. So every `interval`
seconds each device runs a tiny kernel and waits for it (`probe_device`), on a thread of its
own and under `timeout`. A probe that raises or does not return in time marks the device
lost for good (a CUDA context does not recover inside a process): listeners hear it once
(the manager fails the models there and stops placing on it) and readiness names the device
and why. The same loop reads each device's NVML figures when a reader is at hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

from hub.dependencies.calls import BoundedCalls
from hub.dependencies.gpu_metrics import GpuGauges, GpuReader, GpuReading, open_nvml
from hub.periodic import cancel_and_wait

log = logging.getLogger(__name__)

# A blocking call that returns when `device` computed a tiny kernel right, raises otherwise.
DeviceProbe = Callable[[str], None]
LostListener = Callable[[str, str], None]


def probe_device(device: str) -> None:
    """Run a tiny kernel on `device` and wait for its result; raises RuntimeError (CUDA's
    error, or a wrong result) when the device does not compute. A CPU has nothing to lose:
    a no-op there. The kernel runs on a stream of its own, so a long batch on the model's
    stream does not delay the answer."""
    if not device.startswith("cuda"):
        return
    import torch

    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            x = torch.full((64,), 2.0, device=device)
            total = (x * x).sum()
            stream.synchronize()
            value = float(total.item())
    if value != 256.0:
        raise RuntimeError(f"{device} computed {value} for a sum that is 256")


@dataclass(frozen=True)
class DeviceHealth:
    """What the probes of one device saw: `usable` is None before the first probe, False
    for good once one failed (`error` says how)."""

    name: str
    usable: bool | None = None
    error: str | None = None
    # Wall-clock time (epoch seconds) it was found lost.
    lost_at: float | None = None

    def report(self) -> dict[str, object]:
        out: dict[str, object] = {"usable": self.usable}
        if self.error is not None:
            out["error"] = self.error
        if self.lost_at is not None:
            out["lost_at"] = self.lost_at
        return out


def _describe(e: BaseException, timeout: float) -> str:
    if isinstance(e, TimeoutError) or "did not answer" in str(e):
        return f"did not finish a probe kernel within {timeout:g}s"
    text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class DeviceMonitor:
    """Probes `devices` in the background; see the module docstring.

    Contract: `check_now()` probes every device once (start-up); `start()` repeats every
    `interval` seconds until `stop()`; `health()` and `readings()` never block. A device is
    probed by one call at a time; a lost one is never probed again (its stuck probe keeps
    its thread). `on_lost(listener)` hears (device, reason) once per lost device, on the
    event loop. `reader` reads NVML figures (default: `open_nvml()` when a CUDA device is
    configured; None: no GPU metrics).
    """

    def __init__(
        self,
        devices: Sequence[str],
        *,
        interval: float,
        timeout: float,
        probe: DeviceProbe = probe_device,
        reader: GpuReader | bool | None = True,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        self.interval = interval
        self.timeout = timeout
        self._devices = list(devices)
        self._probe = probe
        self._reader_arg = reader
        self._reader: GpuReader | None = None
        self._registry = metrics_registry
        self._gauges: GpuGauges | None = None
        self._calls = {
            d: BoundedCalls(f"{d} probe", workers=1, deadline=timeout) for d in self._devices
        }
        self._health = {d: DeviceHealth(d) for d in self._devices}
        self._readings: dict[str, GpuReading] = {}
        self._listeners: list[LostListener] = []
        self._task: asyncio.Task[None] | None = None
        self._opened = False
        self._usable = Gauge(
            "hub_device_usable",
            "Whether the device computed its last probe kernel (1) or was lost (0)",
            ["device"],
            registry=metrics_registry,
        )

    @property
    def devices(self) -> list[str]:
        return list(self._devices)

    def health(self) -> dict[str, DeviceHealth]:
        return dict(self._health)

    def lost(self) -> dict[str, str]:
        """Lost devices and why."""
        return {d: h.error or "lost" for d, h in self._health.items() if h.usable is False}

    def readings(self) -> dict[str, GpuReading]:
        """The last NVML figures per device (empty without NVML)."""
        return dict(self._readings)

    def on_lost(self, listener: LostListener) -> None:
        self._listeners.append(listener)

    def _open_reader(self) -> None:
        if self._opened:
            return
        self._opened = True
        if self._reader_arg is True:
            if any(d.startswith("cuda") for d in self._devices):
                self._reader = open_nvml()
        elif self._reader_arg is not False and self._reader_arg is not None:
            self._reader = self._reader_arg
        if self._reader is not None:
            self._gauges = GpuGauges(self._registry)

    async def check_now(self) -> None:
        self._open_reader()
        await asyncio.gather(*(self._check(d) for d in self._devices))

    def start(self) -> None:
        if self._task is None and self._devices:
            self._task = asyncio.create_task(self._loop(), name="device probes")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        for calls in self._calls.values():
            calls.close()
        close = getattr(self._reader, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close()

    async def _loop(self) -> None:
        self._open_reader()
        while True:
            await asyncio.sleep(self.interval)
            await asyncio.gather(*(self._check(d) for d in self._devices))

    async def _check(self, device: str) -> None:
        if self._health[device].usable is False or self._calls[device].busy:
            return
        try:
            await self._calls[device].run(self._probe, device)
        except Exception as e:
            self._lose(device, _describe(e, self.timeout))
            return
        if self._health[device].usable is not True:
            self._health[device] = DeviceHealth(device, usable=True)
            self._usable.labels(device).set(1)
        if self._reader is not None:
            await self._read(device)

    async def _read(self, device: str) -> None:
        reader = self._reader
        assert reader is not None
        try:
            reading = await self._calls[device].run(reader.read, device)
        except Exception as e:  # figures missing for a moment: not a lost device
            log.debug("NVML reading of %s failed: %s", device, e)
            self._readings.pop(device, None)
            return
        self._readings[device] = reading
        if self._gauges is not None:
            self._gauges.set(device, reading)

    def _lose(self, device: str, reason: str) -> None:
        self._health[device] = DeviceHealth(device, usable=False, error=reason, lost_at=time.time())
        self._usable.labels(device).set(0)
        self._readings.pop(device, None)
        log.error("device %s is lost (%s): its models fail and nothing is placed on it; "
                  "restart the hub once the GPU is healthy", device, reason)  # fmt: skip
        for listener in self._listeners:
            try:
                listener(device, reason)
            except Exception:
                log.exception("device listener failed")


def lost_report(health: Mapping[str, DeviceHealth]) -> dict[str, dict[str, object]]:
    """The `devices` section of readiness."""
    return {d: h.report() for d, h in health.items()}
