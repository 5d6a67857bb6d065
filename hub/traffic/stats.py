"""This process's traffic per version, and its shadow samples.

Every request the hub serves is counted into the `Tally` of (public model name, version
label, traffic-policy revision it was served under): requests, routed ones (the split chose
the version; the sample-ratio check counts only those), errors (a 5xx or an exception; a
caller's 4xx is not the model's error), tokens and a latency histogram of successful
requests (hub.traffic.histogram). Tallies are cumulative since the process started and
flushed to SQL by `hub.traffic.shared`, where readouts and canaries add up every replica's.

Mirrored shadow requests leave a `ShadowSample` in a bounded window (the last `size`), read
from the model's epoch (the moment this process applied its current traffic policy); shadow
figures stay per process.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from hub.traffic.histogram import Tally


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


# (model, version label, policy revision)
TallyKey = tuple[str, str, int]
# Policy revisions per model whose tallies this process keeps: readouts read one, a canary
# one per step (a canary of more steps would see only other replicas' share of its oldest).
KEPT_REVISIONS = 32


class TrafficStats:
    """Tallies per (model, version label, policy revision) and bounded shadow windows;
    touched only on the event loop."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._seq = itertools.count(1)
        self._last = 0
        self._tallies: dict[TallyKey, Tally] = {}
        # Keys counted into since the last `changed()`: what the next flush writes.
        self._dirty: set[TallyKey] = set()
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
        self,
        model: str,
        label: str,
        *,
        revision: int,
        latency_s: float,
        error: bool,
        routed: bool,
        tokens: int,
    ) -> None:
        key = (model, label, revision)
        tally = self._tallies.get(key)
        if tally is None:
            tally = self._tallies[key] = Tally()
            self._forget_old_revisions(model, revision)
        tally.add(latency_s=latency_s, error=error, routed=routed, tokens=tokens)
        self._dirty.add(key)

    def _forget_old_revisions(self, model: str, revision: int) -> None:
        """Readouts read the current revision and canaries one per step: tallies older than
        KEPT_REVISIONS are dropped once flushed (their rows stay in SQL), so a long-lived
        process whose policies change often does not grow without bound."""
        oldest = revision - KEPT_REVISIONS
        stale = [k for k in self._tallies if k[0] == model and k[2] <= oldest]
        for key in stale:
            if key not in self._dirty:
                del self._tallies[key]

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
    def tallies(self, model: str, revisions: range) -> dict[tuple[str, int], Tally]:
        """{(label, revision): copy of the tally} of `model` for revisions in `revisions`."""
        return {
            (label, rev): tally.copy()
            for (m, label, rev), tally in self._tallies.items()
            if m == model and rev in revisions
        }

    def changed(self) -> dict[TallyKey, Tally]:
        """Copies of the tallies counted into since the previous call (what a flush writes);
        `unflushed` puts them back when the flush failed."""
        dirty, self._dirty = self._dirty, set()
        return {key: self._tallies[key].copy() for key in dirty}

    def unflushed(self, keys: Iterable[TallyKey]) -> None:
        self._dirty.update(keys)

    def shadow_labels(self, model: str) -> list[str]:
        return sorted({label for m, label in self._shadow if m == model})

    def shadow_since(self, model: str, label: str, cursor: int) -> list[ShadowSample]:
        return [s for s in self._shadow.get((model, label), ()) if s.seq > cursor]
