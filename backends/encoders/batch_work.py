"""The work one dynamic batcher has queued and in flight, as its admission and its device see
it (`backends.encoders.batching` keeps the queue; `backends.admission` holds the estimate's rules).

Contract: holding the batcher's lock, the batcher calls `started(key, inputs)` when a forward
pass takes a batch and `finished(key)` when it ends, `admit(size)` before queueing a request
(CapacityError when it would wait too long), and `count_on(device_work)` to join a device's
`DeviceWork`. `outstanding_s()` reads published numbers only (the passes in flight are
republished as one tuple on every change), so any thread may call it: the other models'
admission checks do, through `DeviceWork`, while holding their own batchers' locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from backends.admission import DeviceWork, QueueTimeAdmission

# A pass in flight that has taken more than this many times the average per input reprices
# the queue (the device is contended now).
SLOW_PASS = 1.5

Passes = tuple[tuple[int, float], ...]  # (inputs, started at `clock`) of each pass in flight


class BatchWork:
    """A batcher's queued inputs (`queued`, read from the batcher) and passes in flight, timed
    by `clock`, priced by `admission`'s measured cost per input."""

    def __init__(
        self,
        admission: QueueTimeAdmission,
        queued: Callable[[], int],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.admission = admission
        self.clock = clock
        self._queued = queued
        self._passes: dict[Hashable, tuple[int, float]] = {}
        self.running: Passes = ()
        self._device: DeviceWork | None = None
        self._token: int | None = None

    def count_on(self, device_work: DeviceWork | None) -> None:
        """Count this work on `device_work` (the device the model now runs on) instead of
        the previous one's; None: nowhere."""
        if self._device is not None and self._token is not None:
            self._device.unregister(self._token)
        self._device, self._token = None, None
        if device_work is not None:
            self._token = device_work.register(self.outstanding_s)
            self._device = device_work

    def started(self, key: Hashable, inputs: int) -> None:
        self._passes[key] = (inputs, self.clock())
        self.running = tuple(self._passes.values())

    def finished(self, key: Hashable) -> None:
        self._passes.pop(key, None)
        self.running = tuple(self._passes.values())

    def outstanding_s(self) -> float:
        """Seconds of work outstanding: the queue plus what is left of the passes in
        flight, at the measured average cost per input, over the forward workers (0 until a
        pass was measured)."""
        average = self.admission.seconds_per_pass_input
        if average is None:
            return 0.0
        left = _left(self.running, average, self.clock())
        return (self._queued() * average + left) / self.admission.workers

    def admit(self, size: int) -> None:
        """Raise CapacityError if `size` more inputs would wait too long. With nothing
        queued and a forward worker idle, a request starts at once."""
        admission = self.admission
        workers = admission.workers
        running, queued = self.running, self._queued()
        if queued == 0 and len(running) < workers:
            return
        average = admission.seconds_per_pass_input
        if average is None:
            return
        running_s = _left(running, average, self.clock()) / workers
        elsewhere_s = 0.0
        if self._device is not None:
            # The others' work, each counted up to this model's own: their share.
            own = queued * average / workers + running_s
            elsewhere_s = self._device.outstanding_s(excluding=self._token, within=own)
        slow = self._slow_cost(average)
        admission.check(
            queued,
            size,
            running_s=running_s,
            elsewhere_s=elsewhere_s,
            pass_input_s=None if slow is None else slow[0],
            slow_running_s=None if slow is None else slow[1] / workers,
        )

    def _slow_cost(self, average: float) -> tuple[float, float] | None:
        """(seconds an input costs one worker now, seconds left of the passes in flight at
        that cost) where a pass in flight has already taken more than SLOW_PASS times the
        `average` per input, else None. On a contended device (a burst parsed on the event
        loop, other models' passes) passes slow down at once, long before their end updates
        the average; the margin keeps a pass that is merely unlike the average (one input and
        its fixed cost, unusually long inputs) from repricing the queue."""
        now = self.clock()
        running = self.running
        cost = max([(now - start) / n for n, start in running], default=0.0)
        if cost <= SLOW_PASS * average:
            return None
        return cost, _left(running, cost, now)


def _left(running: Passes, per_input: float, now: float) -> float:
    """What is left of the passes in flight at `per_input` seconds an input (a pass that
    already took longer counts nothing)."""
    return sum(max(0.0, n * per_input - (now - start)) for n, start in running)
