"""The readout's tests: right answers on clear cases, and no p-value from too few samples."""

from __future__ import annotations

import random

import pytest

from hub.traffic.histogram import LatencyHistogram as H
from hub.traffic.significance import (
    INSUFFICIENT,
    mann_whitney,
    percentiles,
    sample_ratio,
    two_proportions,
)

# No torch, FastAPI or SQLAlchemy: also run in a bare environment (make test-pure).
pytestmark = pytest.mark.pure


def test_sample_ratio_passes_a_fair_split_and_flags_a_skewed_one() -> None:
    shares = {"1": 0.9, "2": 0.1}
    fair = sample_ratio({"1": 9020, "2": 980}, shares)
    assert fair.status == "ok" and fair.p_value is not None and fair.p_value > 0.001
    skewed = sample_ratio({"1": 8700, "2": 1300}, shares)
    assert skewed.status == "mismatch" and skewed.p_value is not None and skewed.p_value < 1e-6
    assert "check assignment" in skewed.detail


def test_sample_ratio_is_honest_about_small_and_stray_counts() -> None:
    few = sample_ratio({"1": 30, "2": 2}, {"1": 0.9, "2": 0.1})  # expected 3.2 for "2"
    assert few.status == INSUFFICIENT and few.p_value is None
    assert few.as_dict()["observed"] == {"1": 30, "2": 2}
    stray = sample_ratio({"1": 500, "3": 4}, {"1": 0.5, "2": 0.5})
    assert stray.status == "mismatch" and "outside the split" in stray.detail
    assert sample_ratio({"1": 100}, {"1": 1.0}).status == "n/a"


def test_two_proportions() -> None:
    worse = two_proportions(40, 200, 5, 800, min_n=30)
    assert worse.status == "significant" and worse.statistic is not None and worse.statistic > 0
    assert worse.as_dict()["p_worse"] < 0.001
    same = two_proportions(10, 500, 21, 1000, min_n=30)
    assert same.status == "not significant" and same.as_dict()["p_worse"] > 0.05
    clean = two_proportions(0, 100, 0, 100, min_n=30)
    assert (clean.status, clean.p_value) == ("not significant", 1.0)
    few = two_proportions(3, 10, 0, 500, min_n=30)
    assert few.status == INSUFFICIENT and few.p_value is None and "10 and 500" in few.detail


def test_mann_whitney() -> None:
    rng = random.Random(3)
    base = H.of(rng.gauss(0.010, 0.001) for _ in range(200))
    slow = H.of(rng.gauss(0.015, 0.001) for _ in range(200))
    same = H.of(rng.gauss(0.010, 0.001) for _ in range(200))
    result = mann_whitney(slow, base, min_n=30)
    assert result.status == "significant" and result.as_dict()["median_ratio"] > 1.3
    assert result.as_dict()["p_slower"] < 1e-6
    assert mann_whitney(same, base, min_n=30).status == "not significant"
    assert mann_whitney(H.of([0.015] * 5), base, min_n=30).status == INSUFFICIENT
    flat = mann_whitney(H.of([0.01] * 50), H.of([0.01] * 50), min_n=30)
    assert (flat.status, flat.p_value) == ("not significant", 1.0)


@pytest.mark.parametrize("shift_s", [0.0, 0.0003, 0.001, 0.004])
def test_the_binned_u_test_matches_scipy_on_the_raw_samples(shift_s: float) -> None:
    from scipy.stats import mannwhitneyu

    rng = random.Random(11)
    base = [rng.lognormvariate(-4.6, 0.3) for _ in range(400)]
    ours = [rng.lognormvariate(-4.6, 0.3) + shift_s for _ in range(300)]
    binned = mann_whitney(H.of(ours), H.of(base), min_n=30)
    exact = mannwhitneyu(ours, base, alternative="two-sided")
    greater = mannwhitneyu(ours, base, alternative="greater")
    # Buckets 2.2% wide turn close pairs into ties: U moves by well under 1% of the pairs.
    assert binned.statistic is not None
    assert abs(binned.statistic - exact.statistic) < 0.005 * len(ours) * len(base)
    assert binned.p_value == pytest.approx(exact.pvalue, rel=0.25, abs=0.02)
    assert binned.as_dict()["p_slower"] == pytest.approx(greater.pvalue, rel=0.25, abs=0.02)


def test_histograms_merge_exactly_and_read_percentiles_within_a_bucket() -> None:
    rng = random.Random(5)
    parts = [[rng.expovariate(50) for _ in range(n)] for n in (300, 1, 0, 700)]
    merged = H()
    for part in parts:
        merged = merged.merge(H.of(part))
    everything = [x for part in parts for x in part]
    assert merged == H.of(everything)  # the order replicas flush in does not matter
    assert H.from_json(merged.to_json()) == merged
    exact = percentiles(everything)
    for key, value in merged.percentiles().items():
        assert value == pytest.approx(exact[key], rel=0.025)
    assert H().percentiles() == {"p50": None, "p95": None, "p99": None}


def test_percentiles() -> None:
    values = [float(i) for i in range(1, 101)]
    p = percentiles(values)
    assert p["p50"] == 50.5 and 95 <= (p["p95"] or 0) <= 96 and 99 <= (p["p99"] or 0) <= 100
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None}
