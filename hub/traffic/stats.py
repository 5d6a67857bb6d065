"""Per-version request samples, kept in bounded in-memory windows.

Every request the hub serves leaves one `Sample` under (public model name, version label):
its latency, whether it failed (a 5xx or an exception; a caller's 4xx is not the model's
error), whether the split chose the version (the sample-ratio check counts only those) and
the tokens it reported. Mirrored shadow requests leave a `ShadowSample`. Each window keeps
the last `size` samples.

Samples carry a sequence number from one counter, so a window can be cut at any moment
without clocks: `cursor()` marks "from now on", `since(..., cursor)` reads what came after.
Readouts read from the model's epoch (the moment this process applied its current traffic
policy), canaries from the start of their step. All of it is per hub process: replicas keep
their own windows and a restart starts empty.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Sample:
    seq: int
    at: float  # epoch seconds
    latency_s: float
    error: bool
    # True when the model's traffic split chose this version (not `name@v`, not a default).
    routed: bool
    tokens: int


@dataclass(frozen=True, slots=True)
class ShadowSample:
    seq: int
    at: float
    latency_s: float
    # The primary's latency for the same request, for a side-by-side ratio.
    primary_latency_s: float
    error: str | None
    # 1.0 = same output; None when the outputs could not be compared (e.g. dimensions).
    similarity: float | None


@dataclass(frozen=True)
class Window:
    """What `since` returns: the samples, and whether older ones were already forgotten."""

    samples: list[Sample]
    truncated: bool


class _Ring:
    """The last `size` samples of one version, remembering how far it has forgotten."""

    def __init__(self, size: int) -> None:
        self.items: deque[Sample] = deque(maxlen=size)
        # Sequence number of the newest sample pushed out; windows starting before it are
        # incomplete.
        self.forgotten_upto = 0

    def append(self, sample: Sample) -> None:
        if len(self.items) == self.items.maxlen:
            self.forgotten_upto = self.items[0].seq
        self.items.append(sample)


class TrafficStats:
    """Bounded sample windows per (model, version label); touched only on the event loop."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._seq = itertools.count(1)
        self._last = 0
        self._samples: dict[tuple[str, str], _Ring] = {}
        self._shadow: dict[tuple[str, str], deque[ShadowSample]] = {}
        self._epochs: dict[str, int] = {}

    def cursor(self) -> int:
        """Samples recorded after this call have a larger sequence number than it returns."""
        return self._last

    def _next(self) -> int:
        self._last = next(self._seq)
        return self._last

    # ---- writes -------------------------------------------------------------------------
    def record(
        self, model: str, label: str, *, latency_s: float, error: bool, routed: bool, tokens: int
    ) -> None:
        ring = self._samples.get((model, label))
        if ring is None:
            ring = self._samples[(model, label)] = _Ring(self.size)
        ring.append(Sample(self._next(), time.time(), latency_s, error, routed, tokens))

    def record_shadow(
        self,
        model: str,
        label: str,
        *,
        latency_s: float,
        primary_latency_s: float,
        error: str | None,
        similarity: float | None,
    ) -> None:
        window = self._shadow.get((model, label))
        if window is None:
            window = self._shadow[(model, label)] = deque(maxlen=self.size)
        window.append(
            ShadowSample(self._next(), time.time(), latency_s, primary_latency_s, error, similarity)
        )

    def new_epoch(self, model: str) -> None:
        """The model's traffic policy changed: readouts start counting from here."""
        self._epochs[model] = self.cursor()

    def epoch(self, model: str) -> int:
        return self._epochs.get(model, 0)

    # ---- reads --------------------------------------------------------------------------
    def labels(self, model: str) -> list[str]:
        """Version labels of `model` with samples in memory."""
        return sorted({label for m, label in self._samples if m == model})

    def shadow_labels(self, model: str) -> list[str]:
        return sorted({label for m, label in self._shadow if m == model})

    def since(self, model: str, label: str, cursor: int) -> Window:
        ring = self._samples.get((model, label))
        if ring is None:
            return Window([], truncated=False)
        return Window([s for s in ring.items if s.seq > cursor], ring.forgotten_upto > cursor)

    def shadow_since(self, model: str, label: str, cursor: int) -> list[ShadowSample]:
        return [s for s in self._shadow.get((model, label), ()) if s.seq > cursor]
