"""The readout's tests: right answers on clear cases, and no p-value from too few samples."""

from __future__ import annotations

import random

import pytest

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
    base = [rng.gauss(0.010, 0.001) for _ in range(200)]
    slow = [rng.gauss(0.015, 0.001) for _ in range(200)]
    same = [rng.gauss(0.010, 0.001) for _ in range(200)]
    result = mann_whitney(slow, base, min_n=30)
    assert result.status == "significant" and result.as_dict()["median_ratio"] > 1.3
    assert mann_whitney(same, base, min_n=30).status == "not significant"
    assert mann_whitney(slow[:5], base, min_n=30).status == INSUFFICIENT


def test_percentiles() -> None:
    values = [float(i) for i in range(1, 101)]
    p = percentiles(values)
    assert p["p50"] == 50.5 and 95 <= (p["p95"] or 0) <= 96 and 99 <= (p["p99"] or 0) <= 100
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None}
