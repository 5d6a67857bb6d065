"""The canary decision directly: given the canary's and the baseline's samples of a step,
wait (hold), pass (advance, promote after the last step) or breach (roll back)."""

from __future__ import annotations

import datetime as dt

import pytest

from hub.traffic.canary_analysis import judge_step
from hub.traffic.stats import Sample
from registry.views import CanaryView

# No torch, FastAPI or SQLAlchemy: also run in a bare environment (make test-pure).
pytestmark = pytest.mark.pure


def canary(**overrides: object) -> CanaryView:
    values: dict[str, object] = {
        "id": 1, "model": "emb", "canary_version": 2, "baseline_version": 1,
        "steps": (10.0, 50.0, 100.0), "step_index": 0, "step_started_at": 0.0,
        "interval_s": 60.0, "max_error_rate": 0.05, "max_latency_ratio": 1.5,
        "min_requests": 50, "state": "running", "reason": "", "last_check": None,
        "actor": "test", "created_at": dt.datetime(2026, 1, 1), "finished_at": None,
        **overrides,
    }  # fmt: skip
    return CanaryView(**values)  # type: ignore[arg-type]


def samples(n: int, *, errors: int = 0, latency_s: float = 0.01) -> list[Sample]:
    return [Sample(i, 0.0, latency_s, i < errors, True, 0) for i in range(n)]


def test_too_few_canary_requests_holds_the_step() -> None:
    result = judge_step(canary(), samples(49), samples(500), baseline_window="step")
    assert result.decision == "wait"
    assert "49 of 50 requests" in result.reason


def test_a_healthy_canary_passes_the_step() -> None:
    result = judge_step(canary(), samples(100, errors=1), samples(900, errors=9),
                        baseline_window="step")  # fmt: skip
    assert result.decision == "pass"
    assert result.check["canary"]["requests"] == 100
    assert result.check["baseline"]["window"] == "step"


def test_an_error_rate_above_the_limit_and_the_baseline_rolls_back() -> None:
    result = judge_step(canary(), samples(100, errors=20), samples(900, errors=9),
                        baseline_window="step")  # fmt: skip
    assert result.decision == "breach"
    assert "error rate 20.0% is above 5.0%" in result.reason


def test_errors_shared_with_the_baseline_do_not_blame_the_canary() -> None:
    # Both fail 20%: above the limit, but not worse than the baseline.
    result = judge_step(canary(), samples(100, errors=20), samples(900, errors=180),
                        baseline_window="step")  # fmt: skip
    assert result.decision == "pass"


def test_without_baseline_samples_the_absolute_limit_decides() -> None:
    bad = judge_step(canary(), samples(100, errors=10), [], baseline_window="none")
    good = judge_step(canary(), samples(100, errors=2), [], baseline_window="none")
    assert (bad.decision, good.decision) == ("breach", "pass")
    assert bad.check["error_test"] is None


def test_a_slow_canary_rolls_back_on_the_latency_ratio() -> None:
    result = judge_step(canary(), samples(100, latency_s=0.04), samples(900, latency_s=0.02),
                        baseline_window="step")  # fmt: skip
    assert result.decision == "breach"
    assert "2.00x the baseline's" in result.reason
    assert result.check["latency_ratio_p95"] == 2.0
