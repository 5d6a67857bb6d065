"""Admission control by queue time: refuse at once the work that would wait too long.

A queue that only bounds its length (`max_queue`) absorbs a burst: every request is admitted
and all of them wait, so the latency of everything grows with the burst. Bounding the *time*
a request would wait instead sheds the excess with 503 + Retry-After while the admitted work
keeps a bounded latency.

Contract: `QueueTimeAdmission.check(ahead, size)` raises `CapacityError` when the `ahead`
inputs already waiting would keep a new request queued longer than `max_queue_time_s`, with
the queue's state (inputs ahead, estimated wait, measured rate) in the message, a
`retry_after` of about the time the queue needs to drain to the bound, and that time itself
as `saturated_s` (the HTTP edge refuses the model's next requests at once until then). The
estimate is `ahead x seconds per input`, the seconds per input an exponentially weighted
average of what the forward passes took (`observe`), divided by the forward workers running
in parallel, plus what the caller says is left of its passes in flight (`running_s`) and
the share of the device the other models there take meanwhile (`elsewhere_s`, from
`DeviceWork`: each other model's outstanding work counted up to this model's own).
Until a first pass has been measured nothing is refused (no rate is known), and a request to
a model with nothing queued and nothing running is always admitted (so no model starves
behind another's steady load), as is one that an idle forward worker can start at once (the
batcher's rule).
The caller serialises calls (the batcher holds its lock).

Why the passes in flight and the device count: a queue that only counts the inputs still
waiting empties every time a forward pass takes them, so under a burst each new pass let in
another round of requests that then waited for it; and two models on one CPU each estimated
their wait as if they had the cores alone. `DeviceWork` is the device-wide view: each model's
batcher (and each LLM engine) registers a lock-free reading of its outstanding seconds
(queued plus what is left of its passes), and an admission check sums the others', each up
to its own wait: models sharing a device slow each other only while both have work, so
another model's backlog delays a request by at most as much as it waits for its own model's
work. Counting the others' whole backlog as if it ran first refused an embedder's requests
behind an LLM's generations, which run interleaved with everyone's work for many steps.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable

from backends.errors import CapacityError

# Weight of the newest pass in the average: about the last ten passes count.
EWMA_ALPHA = 0.2


class QueueTimeAdmission:
    """Estimates a queue's wait from its measured service rate and refuses what would wait
    longer than `max_queue_time_s` (None: never refuses, only measures)."""

    def __init__(
        self,
        max_queue_time_s: float | None,
        *,
        name: str,
        workers: int = 1,
        unit: str = "inputs",
        min_retry_after_s: float = 1.0,
        alpha: float = EWMA_ALPHA,
    ) -> None:
        if max_queue_time_s is not None and max_queue_time_s < 0:
            raise ValueError("max_queue_time_s must be >= 0")
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.max_queue_time_s = max_queue_time_s
        self.name = name
        self.workers = max(1, workers)
        self.unit = unit  # what the queue holds, for messages: "inputs", "sequences"
        self.min_retry_after_s = min_retry_after_s
        self._alpha = alpha
        self._seconds_per_input: float | None = None

    @property
    def seconds_per_input(self) -> float | None:
        """The averaged cost of one input in the queue (all workers together), or None."""
        if self._seconds_per_input is None:
            return None
        return self._seconds_per_input / self.workers

    def observe(self, inputs: int, busy_s: float) -> None:
        """`inputs` left the queue in `busy_s` seconds (one forward pass served them)."""
        if inputs < 1 or not math.isfinite(busy_s) or busy_s < 0:
            return
        sample = busy_s / inputs
        if self._seconds_per_input is None:
            self._seconds_per_input = sample
        else:
            self._seconds_per_input += self._alpha * (sample - self._seconds_per_input)

    def estimated_wait(self, ahead: int) -> float | None:
        """Seconds a request arriving behind `ahead` queued inputs would wait, or None while
        no pass has been measured."""
        per_input = self.seconds_per_input
        return None if per_input is None else ahead * per_input

    @property
    def seconds_per_pass_input(self) -> float | None:
        """The averaged cost of one input on one worker (not divided by the workers)."""
        return self._seconds_per_input

    def check(
        self,
        ahead: int,
        size: int,
        *,
        running_s: float = 0.0,
        elsewhere_s: float = 0.0,
        pass_input_s: float | None = None,
        slow_running_s: float | None = None,
    ) -> None:
        """Admit a request of `size` inputs behind `ahead` queued ones, or raise
        CapacityError naming the queue's state. `running_s`: what is left of this model's
        passes in flight at the average cost; `elsewhere_s`: the share of its device the
        other models take meanwhile (`DeviceWork.outstanding_s(within=...)`);
        `pass_input_s` and `slow_running_s`: what an input costs one
        worker now and what is left of the passes at that cost, where the caller knows
        better than the average (a pass in flight is already much slower: the device is
        contended). A contended device is counted once: the estimate is the larger of this
        model's work at the cost now and its work at the average plus the others' work."""
        bound = self.max_queue_time_s
        average = self._seconds_per_input
        if bound is None or average is None or (ahead == 0 and running_s <= 0):
            return
        now = max(average, pass_input_s or 0.0)
        slow = (ahead * now / self.workers, max(0.0, slow_running_s or running_s), 0.0)
        shared = (ahead * average / self.workers, max(0.0, running_s), max(0.0, elsewhere_s))
        queued, running, elsewhere = max(slow, shared, key=sum)
        wait = queued + running + elsewhere
        if wait <= bound:
            return
        per_input = now / self.workers if queued == slow[0] else average / self.workers
        rate = 1 / per_input if per_input > 0 else float("inf")
        retry_after = max(self.min_retry_after_s, math.ceil(wait - bound))
        parts = ""
        if running > 0 or elsewhere > 0:
            parts = (
                f" ({queued:.2f}s queued, {running:.2f}s left of passes running, "
                f"{elsewhere:.2f}s of other models' work on its device)"
            )
        raise CapacityError(
            f"{self.name} is overloaded: {ahead} {self.unit} wait ahead of this request "
            f"({size} {self.unit}), an estimated {wait:.2f}s{parts} at the measured "
            f"{rate:.0f} {self.unit}/s, "
            f"more than its max_queue_time_ms ({bound * 1000:g}); retry after "
            f"{retry_after:g}s or send fewer concurrent requests",
            retry_after=retry_after,
            # Arrivals only add to the queue: it stays over the bound at least this long,
            # unless this model's own work ends first (then an idle worker takes the next).
            saturated_s=min(wait - bound, queued + running),
        )


class DeviceWork:
    """The work every model serving from one device has outstanding, in seconds: models on
    one device share its compute, so a request to one waits for (or runs beside, as slowly)
    what the others have queued. Sources are callables returning their outstanding seconds;
    they must not block or take locks a caller might hold (the batcher's read published
    numbers only). Thread-safe."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._sources: dict[int, Callable[[], float]] = {}
        self._ids = itertools.count(1)

    def register(self, source: Callable[[], float]) -> int:
        """Add a source; returns the token that `unregister` and `outstanding_s` take."""
        with self._lock:
            token = next(self._ids)
            self._sources[token] = source
            return token

    def unregister(self, token: int) -> None:
        with self._lock:
            self._sources.pop(token, None)

    def __len__(self) -> int:
        """Sources counted now."""
        with self._lock:
            return len(self._sources)

    def outstanding_s(self, excluding: int | None = None, within: float = math.inf) -> float:
        """The sum of every source's outstanding seconds but `excluding`'s, each counted up
        to `within`: the share of the device the others take from a model that has `within`
        seconds of its own work to wait for (while both have work they share the device, so
        another model's backlog delays it by at most as much again, however long that
        backlog is)."""
        with self._lock:
            sources = [f for token, f in self._sources.items() if token != excluding]
        return sum(min(max(0.0, source()), within) for source in sources)


_DEVICES: dict[str, DeviceWork] = {}
_DEVICES_LOCK = threading.Lock()


def device_work(device: str) -> DeviceWork:
    """The process's `DeviceWork` for `device` ("cpu", "cpu:0" and "cpu" are one device;
    "cuda:0" and "cuda:1" are two)."""
    key = "cpu" if device.startswith("cpu") else device
    with _DEVICES_LOCK:
        work = _DEVICES.get(key)
        if work is None:
            work = _DEVICES[key] = DeviceWork(key)
        return work
