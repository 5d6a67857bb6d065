"""A mergeable latency histogram with fixed bucket bounds, and one version's traffic tally.

Every replica counts its requests into `Tally`s (requests, routed, errors, tokens, and the
latencies of successful requests as a `LatencyHistogram`) and flushes them to SQL; a readout
or a canary adds up the tallies of every replica. Because the bucket bounds are fixed (the
same in every process and every release), adding two histograms is exact: the sum is the
histogram of the union of their samples, whatever order the replicas flushed in.

Bounds: bucket `i` holds latencies in [LOW * G**i, LOW * G**(i+1)) with G = 2**(1/32), a
2.2% wide bucket, from 0.1 ms (everything faster lands in bucket 0) upwards without limit.
Percentiles read from it are within one bucket (2.2%) of the exact ones; the Mann-Whitney U
test (hub.traffic.significance) treats each bucket as a group of ties. Stored sparse, as
{bucket index: count}, so a version served in a narrow band of latencies takes a few dozen
entries.

Pure: no torch, SQL or Prometheus.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

LOW_S = 1e-4
BUCKETS_PER_DOUBLING = 32


def bucket_of(latency_s: float) -> int:
    """The index of the bucket that holds `latency_s` (seconds)."""
    if not latency_s > LOW_S:  # also NaN and negatives: bucket 0
        return 0
    return max(0, math.floor(math.log2(latency_s / LOW_S) * BUCKETS_PER_DOUBLING))


def bucket_bounds(index: int) -> tuple[float, float]:
    """[low, high) of bucket `index`, in seconds."""
    low = LOW_S * 2 ** (index / BUCKETS_PER_DOUBLING)
    return low, LOW_S * 2 ** ((index + 1) / BUCKETS_PER_DOUBLING)


@dataclass
class LatencyHistogram:
    """Counts per fixed bucket; `merge` is exact (bucket-wise addition)."""

    counts: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, latencies_s: Iterable[float]) -> LatencyHistogram:
        h = cls()
        for x in latencies_s:
            h.add(x)
        return h

    @property
    def n(self) -> int:
        return sum(self.counts.values())

    def add(self, latency_s: float, count: int = 1) -> None:
        i = bucket_of(latency_s)
        self.counts[i] = self.counts.get(i, 0) + count

    def merge(self, other: LatencyHistogram) -> LatencyHistogram:
        """A new histogram holding the samples of both."""
        out = dict(self.counts)
        for i, c in other.counts.items():
            out[i] = out.get(i, 0) + c
        return LatencyHistogram(out)

    def sorted_bins(self) -> list[tuple[int, int]]:
        return sorted((i, c) for i, c in self.counts.items() if c > 0)

    def quantile(self, q: float) -> float | None:
        """The `q` quantile (0..1), linear within the bucket it falls in; None when empty."""
        n = self.n
        if n == 0:
            return None
        rank = q * (n - 1)  # 0-based, as numpy's linear percentile
        seen = 0
        for i, c in self.sorted_bins():
            if rank < seen + c:
                low, high = bucket_bounds(i)
                # Spread a bucket's c samples evenly over it, at the centres of c equal parts.
                return low + (high - low) * ((rank - seen) + 0.5) / c
            seen += c
        low, high = bucket_bounds(self.sorted_bins()[-1][0])
        return (low + high) / 2

    def percentiles(self) -> dict[str, float | None]:
        return {"p50": self.quantile(0.50), "p95": self.quantile(0.95), "p99": self.quantile(0.99)}

    def to_json(self) -> dict[str, int]:
        return {str(i): c for i, c in self.sorted_bins()}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any] | None) -> LatencyHistogram:
        return cls({int(i): int(c) for i, c in (doc or {}).items()})


@dataclass
class Tally:
    """One version's traffic in one window: counts, tokens, time busy on successful requests
    and their latency histogram. A caller's 4xx is not recorded; a 5xx is an error."""

    requests: int = 0
    # Requests the model's split chose (not `name@v`, not the default).
    routed: int = 0
    errors: int = 0
    tokens: int = 0
    # Sum of the latencies of successful requests (tokens per second = tokens / busy_s).
    busy_s: float = 0.0
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)

    def add(self, *, latency_s: float, error: bool, routed: bool, tokens: int) -> None:
        self.requests += 1
        self.routed += routed
        if error:
            self.errors += 1
            return
        self.tokens += tokens
        self.busy_s += latency_s
        self.latency.add(latency_s)

    def merge(self, other: Tally) -> Tally:
        return Tally(
            requests=self.requests + other.requests,
            routed=self.routed + other.routed,
            errors=self.errors + other.errors,
            tokens=self.tokens + other.tokens,
            busy_s=self.busy_s + other.busy_s,
            latency=self.latency.merge(other.latency),
        )

    def copy(self) -> Tally:
        return Tally().merge(self)

    @staticmethod
    def total(tallies: Iterable[Tally]) -> Tally:
        out = Tally()
        for t in tallies:
            out = out.merge(t)
        return out
