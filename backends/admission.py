"""Admission control by queue time: refuse at once the work that would wait too long.

A queue that only bounds its length (`max_queue`) absorbs a burst: every request is admitted
and all of them wait, so the latency of everything grows with the burst. Bounding the *time*
a request would wait instead sheds the excess with 503 + Retry-After while the admitted work
keeps a bounded latency.

Contract: `QueueTimeAdmission.check(ahead, size)` raises `CapacityError` when the `ahead`
inputs already waiting would keep a new request queued longer than `max_queue_time_s`, with
the queue's state (inputs ahead, estimated wait, measured rate) in the message and a
`retry_after` of about the time the queue needs to drain to the bound. The estimate is
`ahead x seconds per input`, the seconds per input an exponentially weighted average of what
the forward passes took (`observe`), divided by the forward workers running in parallel. Until
a first pass has been measured nothing is refused (no rate is known). Pure Python: no clock,
no threads; the caller serialises calls (the batcher holds its lock).
"""

from __future__ import annotations

import math

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

    def check(self, ahead: int, size: int) -> None:
        """Admit a request of `size` inputs behind `ahead` queued ones, or raise
        CapacityError naming the queue's state."""
        bound = self.max_queue_time_s
        wait = self.estimated_wait(ahead)
        if bound is None or wait is None or wait <= bound:
            return
        per_input = self.seconds_per_input or 0.0
        rate = 1 / per_input if per_input > 0 else float("inf")
        retry_after = max(self.min_retry_after_s, math.ceil(wait - bound))
        raise CapacityError(
            f"{self.name} is overloaded: {ahead} {self.unit} wait ahead of this request "
            f"({size} {self.unit}), an estimated {wait:.2f}s at the measured {rate:.0f} "
            f"{self.unit}/s, "
            f"more than its max_queue_time_ms ({bound * 1000:g}); retry after "
            f"{retry_after:g}s or send fewer concurrent requests",
            retry_after=retry_after,
        )
