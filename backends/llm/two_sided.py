"""Two ways to run the same work, measured side by side per bucket, and which to take next.

The engine has choices no constant settles, because the better one depends on the model, the
machine and its load at the time: whether a fused step runs on all its threads or on half
(`fused.threads`), whether a decode step verifies drafts or not (`speculative.cost`). Each
is made per bucket (a step size, a batch size) from recent measurements of both ways, side
A (the default) and side B (the alternative):

- each side keeps a short window of its recent samples (seconds, or seconds per sequence),
  scored by a function the owner picks (a trimmed mean, a median);
- a bucket's first steps take the side it measures first until `min_samples` are in, then
  the other side until as many are;
- after that a step takes the side the owner's rule says wins on the two scores, and one
  decision in `probe_a_every` (while B wins) or `probe_b_every` (while A wins) takes the
  other side, so that a change of load turns the choice back.

The owner says when a step may measure the side not chosen (`may_probe`): a step where the
slower side would cost a user dearly (a prefill, whose time is the time to first token) then
stays on the side believed faster, and the measurement waits for a cheaper step.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

# A side's score from its window of recent samples (lower is better for the owner's rule).
Score = Callable[[Sequence[float]], float]
# Whether side B wins, given the scores of side A and side B.
BWins = Callable[[float, float], bool]


@dataclass
class _Bucket:
    # Recent samples of side A and side B.
    a: collections.deque[float]
    b: collections.deque[float]
    decisions: int = field(default=0)


class TwoSided(Generic[K]):
    """Recent samples of side A and side B per bucket `K`; `choose` picks the side a step
    takes (False: A, True: B), `record` adds what a step measured. Not thread-safe: one
    owner records and chooses one step at a time."""

    def __init__(
        self,
        *,
        window: int,
        min_samples: int,
        score: Score,
        probe_a_every: int,
        probe_b_every: int,
    ) -> None:
        """`window`: samples kept per side; `min_samples`: samples of each side before
        they are compared; `probe_a_every` / `probe_b_every`: one decision in this many
        takes side A while B wins / side B while A wins."""
        if not 0 < min_samples <= window:
            raise ValueError("two-sided measurement: 0 < min_samples <= window")
        if probe_a_every < 1 or probe_b_every < 1:
            raise ValueError("two-sided measurement: probe periods must be at least 1")
        self._window = window
        self._min_samples = min_samples
        self._score = score
        self._probe_a_every = probe_a_every
        self._probe_b_every = probe_b_every
        self._buckets: dict[K, _Bucket] = {}

    def _bucket(self, key: K) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            window = self._window
            bucket = _Bucket(collections.deque(maxlen=window), collections.deque(maxlen=window))
            self._buckets[key] = bucket
        return bucket

    def buckets(self) -> Iterator[K]:
        """The buckets that have been asked about or recorded into, in first-seen order."""
        return iter(list(self._buckets))

    def samples(self, key: K, b: bool) -> int:
        """Samples side B (`b`) or side A holds in bucket `key`."""
        bucket = self._buckets.get(key)
        if bucket is None:
            return 0
        return len(bucket.b if b else bucket.a)

    def score(self, key: K, b: bool) -> float | None:
        """Side B's (`b`) or side A's score in bucket `key`; None while it has no sample."""
        bucket = self._buckets.get(key)
        window = None if bucket is None else (bucket.b if b else bucket.a)
        return self._score(window) if window else None

    def measured(self, key: K) -> bool:
        """Whether both sides of bucket `key` hold `min_samples`, so they can be compared."""
        return min(self.samples(key, False), self.samples(key, True)) >= self._min_samples

    def winner(self, key: K, b_wins: BWins) -> bool | None:
        """Which side wins in bucket `key` by `b_wins` on the two scores (True: B), without
        a probe; None until the bucket is `measured`."""
        if not self.measured(key):
            return None
        bucket = self._buckets[key]
        return b_wins(self._score(bucket.a), self._score(bucket.b))

    def choose(self, key: K, b_wins: BWins, *, first: bool = False, may_probe: bool = True) -> bool:
        """The side (True: B) a step in bucket `key` takes, counted as a decision.

        `first`: the side measured first while the bucket has fewer than `min_samples` of
        it; the other side is measured next, only on steps that `may_probe`. Once both are
        measured: `b_wins` on their scores, or the other side on a probe (due every
        `probe_a_every` / `probe_b_every` decisions, taken only where `may_probe`)."""
        bucket = self._bucket(key)
        bucket.decisions += 1
        if len(bucket.b if first else bucket.a) < self._min_samples:
            return first
        if len(bucket.a if first else bucket.b) < self._min_samples:
            return (not first) if may_probe else first
        b = b_wins(self._score(bucket.a), self._score(bucket.b))
        every = self._probe_a_every if b else self._probe_b_every
        if may_probe and bucket.decisions % every == 0:
            return not b
        return b

    def record(self, key: K, b: bool, sample: float) -> None:
        """A step in bucket `key` took side B (`b`) or side A and measured `sample`."""
        bucket = self._bucket(key)
        (bucket.b if b else bucket.a).append(sample)
