"""The statistical tests behind readouts and canary decisions, honest about small samples.

Each test returns a `TestResult`. Below its minimum sample size it reports `insufficient
data` with the counts and no p-value: a p-value from a handful of requests would look like
evidence and is not. The tests:

- sample-ratio mismatch: Pearson's chi-square of the routed counts against the shares the
  split intends (a mismatch means the assignment or the logging is broken, and every other
  comparison is suspect);
- error rates: two-proportion z-test (pooled), two-sided and one-sided (candidate worse);
- latency: Mann-Whitney U on the latency histograms of successful requests (binned, with
  tie correction), the same function for readouts and canaries.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from hub.traffic.histogram import LatencyHistogram

INSUFFICIENT = "insufficient data"
# Sample-ratio mismatch is declared at p < 0.001 (the usual SRM threshold: a real mismatch
# gives tiny p-values, and A/B tools run this check on every experiment).
SRM_ALPHA = 0.001
# A chi-square approximation needs an expected count of at least this in every cell.
MIN_EXPECTED = 5.0


@dataclass(frozen=True)
class TestResult:
    test: str
    # "ok" | "mismatch" (SRM) | "significant" | "not significant" | INSUFFICIENT | "n/a"
    status: str
    p_value: float | None = None
    statistic: float | None = None
    detail: str = ""
    extra: Mapping[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc.update(doc.pop("extra") or {})
        return doc


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50, p95 and p99 (linear interpolation); None for an empty list."""
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    p50, p95, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99)}


def sample_ratio(observed: Mapping[str, int], expected_share: Mapping[str, float]) -> TestResult:
    """Chi-square goodness of fit of `observed` routed counts to `expected_share` (shares
    summing to 1, over the same labels)."""
    from scipy.stats import chisquare

    test = "chi-square sample-ratio"
    labels = sorted(expected_share)
    total = sum(observed.get(label, 0) for label in labels)
    stray = {k: v for k, v in observed.items() if k not in expected_share and v}
    if len(labels) < 2:
        return TestResult(test, "n/a", detail="one version receives all routed traffic")
    expected = {label: total * expected_share[label] for label in labels}
    counts = {label: observed.get(label, 0) for label in labels}
    extra = {"observed": counts, "expected": {k: round(v, 1) for k, v in expected.items()}}
    if stray:
        return TestResult(
            test,
            "mismatch",
            detail=f"requests were routed to versions outside the split: {stray}",
            extra=extra,
        )
    if total == 0 or min(expected.values()) < MIN_EXPECTED:
        return TestResult(
            test,
            INSUFFICIENT,
            detail=f"{total} routed requests; every version needs an "
            f"expected count of at least {MIN_EXPECTED:g}",
            extra=extra,
        )
    result = chisquare([counts[k] for k in labels], [expected[k] for k in labels])
    p = float(result.pvalue)
    status = "mismatch" if p < SRM_ALPHA else "ok"
    detail = (
        f"routed counts deviate from the split (p = {p:.2g} < {SRM_ALPHA}); check assignment "
        "and logging before trusting any comparison"
        if status == "mismatch"
        else f"routed counts are consistent with the split (p = {p:.3g})"
    )
    return TestResult(test, status, p, float(result.statistic), detail, extra)


def two_proportions(
    errors: int, n: int, base_errors: int, base_n: int, *, min_n: int, alpha: float = 0.05
) -> TestResult:
    """Does the candidate (errors/n) fail at another rate than the baseline? `p_value` is
    two-sided; `p_worse` one-sided for the candidate failing more often."""
    from scipy.stats import norm

    test = "two-proportion z"
    extra: dict[str, Any] = {
        "errors": errors,
        "requests": n,
        "baseline_errors": base_errors,
        "baseline_requests": base_n,
    }
    if n < min_n or base_n < min_n:
        return TestResult(
            test,
            INSUFFICIENT,
            detail=f"{n} and {base_n} requests; at least {min_n} each are needed",
            extra=extra,
        )
    pooled = (errors + base_errors) / (n + base_n)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n + 1 / base_n))
    if se == 0:  # no errors anywhere, or only errors: the rates are equal
        extra["p_worse"] = 1.0 if errors / n <= base_errors / base_n else 0.0
        return TestResult(test, "not significant", 1.0, 0.0, "identical error rates", extra)
    z = (errors / n - base_errors / base_n) / se
    p = float(2 * norm.sf(abs(z)))
    extra["p_worse"] = float(norm.sf(z))
    status = "significant" if p < alpha else "not significant"
    return TestResult(
        test,
        status,
        p,
        float(z),
        f"error rate {errors / n:.4f} vs {base_errors / base_n:.4f}",
        extra,
    )


def mann_whitney(
    latency: LatencyHistogram,
    base_latency: LatencyHistogram,
    *,
    min_n: int,
    alpha: float = 0.05,
) -> TestResult:
    """Do the candidate's latencies come from another distribution than the baseline's?

    Mann-Whitney U on binned data (the merged histograms of every replica): each bucket is a
    group of ties, the variance carries the tie correction, and z the continuity correction,
    as scipy.stats.mannwhitneyu's asymptotic method does on raw samples. `p_value` is
    two-sided; `p_slower` one-sided for the candidate being slower; `median_ratio` (candidate
    over baseline) is the size of the effect, which a canary weighs against its limit (the
    test alone would flag a 2% difference on enough requests)."""
    from scipy.stats import norm

    test = "Mann-Whitney U"
    n1, n2 = latency.n, base_latency.n
    extra: dict[str, Any] = {"requests": n1, "baseline_requests": n2}
    if n1 < min_n or n2 < min_n:
        return TestResult(
            test,
            INSUFFICIENT,
            detail=f"{n1} and {n2} successful requests; at least {min_n} each are needed",
            extra=extra,
        )
    ours, base = latency.counts, base_latency.counts
    u = 0.0  # pairs (candidate, baseline) where the candidate is slower, ties counting half
    below = 0  # baseline samples in lower buckets
    ties = 0
    for i in sorted(ours.keys() | base.keys()):
        a, b = ours.get(i, 0), base.get(i, 0)
        u += a * (below + 0.5 * b)
        below += b
        ties += (a + b) ** 3 - (a + b)
    n = n1 + n2
    mean = n1 * n2 / 2
    variance = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
    ratio = (latency.quantile(0.5) or 0.0) / max(base_latency.quantile(0.5) or 0.0, 1e-12)
    extra["median_ratio"] = round(ratio, 4)
    extra["p_slower"] = 0.5
    extra["probability_slower"] = round(u / (n1 * n2), 4)
    if variance <= 0:  # every sample in one bucket: nothing tells the versions apart
        return TestResult(test, "not significant", 1.0, u, "identical latencies", extra)
    sd = math.sqrt(variance)
    z = (max(u, n1 * n2 - u) - mean - 0.5) / sd
    p = float(min(1.0, 2 * norm.sf(z)))
    extra["p_slower"] = float(norm.sf((u - mean - 0.5) / sd))
    status = "significant" if p < alpha else "not significant"
    return TestResult(
        test, status, p, u, f"median latency ratio {ratio:.3f} to the baseline", extra
    )
