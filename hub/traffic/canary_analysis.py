"""One canary step judged: the canary's window against the baseline's, with the thresholds.

Pure: it takes the samples and returns a decision (`wait`, `pass` or `breach`), the reason in
words and the figures it used (stored with the canary as its last check).

- errors: a breach when the canary's error rate is above `max_error_rate` *and* a one-sided
  two-proportion z-test says it fails more often than the baseline (p < 0.05), so a bad
  moment shared by both versions does not blame the canary; with no baseline samples at all
  (a restarted hub at a 100% step) the absolute threshold decides alone;
- latency: a breach when the ratio of p95 latencies of successful requests (canary over
  baseline) is above `max_latency_ratio`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hub.traffic.significance import percentiles, two_proportions
from hub.traffic.stats import Sample
from registry.views import CanaryView

# One-sided significance for "the canary fails more often than the baseline".
CANARY_ALPHA = 0.05


@dataclass(frozen=True)
class Analysis:
    decision: str  # "wait" | "pass" | "breach"
    reason: str
    check: dict[str, Any]


def _arm(samples: list[Sample]) -> dict[str, Any]:
    ok = [s.latency_s for s in samples if not s.error]
    errors = len(samples) - len(ok)
    p95 = percentiles(ok)["p95"]
    return {
        "requests": len(samples),
        "errors": errors,
        "error_rate": round(errors / len(samples), 6) if samples else None,
        "p95_ms": None if p95 is None else round(p95 * 1000, 3),
    }


def judge_step(
    canary: CanaryView, ours: list[Sample], base: list[Sample], *, baseline_window: str
) -> Analysis:
    """`ours`: the canary's samples in this step; `base`: the baseline's, from the window
    named by `baseline_window` ("step", "canary" or "none" when it has too few)."""
    need, scope = canary.min_requests, baseline_window
    check: dict[str, Any] = {
        "step_index": canary.step_index,
        "weight": canary.weight,
        "canary": _arm(ours),
        "baseline": {**_arm(base), "window": scope},
    }
    if len(ours) < need:
        return Analysis(
            "wait",
            f"canary v{canary.canary_version} has {len(ours)} of "
            f"{need} requests needed in this step",
            check,
        )
    breaches = []
    errors = sum(1 for s in ours if s.error)
    rate = errors / len(ours)
    if scope == "none":
        worse = True  # nothing to compare with: the absolute threshold decides alone
        check["error_test"] = None
    else:
        test = two_proportions(
            errors, len(ours), sum(1 for s in base if s.error), len(base), min_n=need
        )
        check["error_test"] = test.as_dict()
        worse = (test.extra or {}).get("p_worse", 1.0) < CANARY_ALPHA
    if rate > canary.max_error_rate and worse:
        breaches.append(
            f"error rate {rate:.1%} is above {canary.max_error_rate:.1%}"
            + ("" if scope == "none" else " and significantly above the baseline's")
        )
    ours_p95, base_p95 = check["canary"]["p95_ms"], check["baseline"]["p95_ms"]
    ratio = None
    if ours_p95 is not None and base_p95 is not None and scope != "none" and base_p95 > 0:
        ratio = ours_p95 / base_p95
        if ratio > canary.max_latency_ratio:
            breaches.append(
                f"p95 latency {ours_p95:.1f} ms is {ratio:.2f}x the baseline's "
                f"{base_p95:.1f} ms (limit {canary.max_latency_ratio:g}x)"
            )
    check["latency_ratio_p95"] = None if ratio is None else round(ratio, 4)
    at = f"at {canary.weight:g}% (step {canary.step_index + 1} of {len(canary.steps)})"
    if breaches:
        return Analysis(
            "breach", f"canary v{canary.canary_version} {at}: " + "; ".join(breaches), check
        )
    latency = "" if ratio is None else f", p95 ratio {ratio:.2f}"
    return Analysis("pass", f"{at}: error rate {rate:.1%}{latency}", check)
