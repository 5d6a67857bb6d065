"""One canary step judged: the canary's tally against the baseline's, with the thresholds.

Pure: it takes the two tallies (every replica's traffic, summed) and returns a decision
(`wait`, `pass` or `breach`), the reason in words and the figures it used (stored with the
canary as its last check).

- errors: a breach when the canary's error rate is above `max_error_rate` *and* a one-sided
  two-proportion z-test says it fails more often than the baseline (p < 0.05), so a bad
  moment shared by both versions does not blame the canary; with no baseline traffic at all
  only the absolute threshold decides;
- latency: as Kayenta judges it, a breach when a Mann-Whitney U test on the latency
  histograms says the canary is slower (one-sided p < 0.05) *and* the effect is large: its
  median latency above `max_latency_ratio` times the baseline's. The test is the readout's
  (`hub.traffic.significance.mann_whitney`). A busy CPU slows both versions alike and
  stretches the tails, which is why neither a bare p95 ratio nor the test alone decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hub.traffic.histogram import Tally
from hub.traffic.significance import mann_whitney, two_proportions
from registry.views import CanaryView

# One-sided significance for "the canary fails more often / is slower than the baseline".
CANARY_ALPHA = 0.05


@dataclass(frozen=True)
class Analysis:
    decision: str  # "wait" | "pass" | "breach"
    reason: str
    check: dict[str, Any]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def _arm(tally: Tally) -> dict[str, Any]:
    return {
        "requests": tally.requests,
        "errors": tally.errors,
        "error_rate": round(tally.errors / tally.requests, 6) if tally.requests else None,
        "p50_ms": _ms(tally.latency.quantile(0.50)),
        "p95_ms": _ms(tally.latency.quantile(0.95)),
    }


def judge_step(
    canary: CanaryView,
    ours: Tally,
    base: Tally,
    *,
    baseline_window: str,
    replicas: list[str] | None = None,
) -> Analysis:
    """`ours`: the canary's traffic in this step; `base`: the baseline's, from the window
    named by `baseline_window` ("step", "canary", or "none" when it has too little);
    `replicas`: the replicas whose traffic the tallies add up."""
    need, scope = canary.min_requests, baseline_window
    check: dict[str, Any] = {
        "step_index": canary.step_index,
        "weight": canary.weight,
        "replicas": list(replicas or []),
        "canary": _arm(ours),
        "baseline": {**_arm(base), "window": scope},
    }
    if ours.requests < need:
        return Analysis(
            "wait",
            f"canary v{canary.canary_version} has {ours.requests} of "
            f"{need} requests needed in this step",
            check,
        )
    breaches = []
    rate = ours.errors / ours.requests
    if scope == "none":
        worse = True  # nothing to compare with: the absolute threshold decides alone
        check["error_test"] = None
    else:
        test = two_proportions(ours.errors, ours.requests, base.errors, base.requests, min_n=need)
        check["error_test"] = test.as_dict()
        worse = (test.extra or {}).get("p_worse", 1.0) < CANARY_ALPHA
    if rate > canary.max_error_rate and worse:
        breaches.append(
            f"error rate {rate:.1%} is above {canary.max_error_rate:.1%}"
            + ("" if scope == "none" else " and significantly above the baseline's")
        )
    ratio = None
    check["latency_test"] = None
    if scope != "none":
        latency = mann_whitney(ours.latency, base.latency, min_n=need)
        check["latency_test"] = latency.as_dict()
        extra = latency.extra or {}
        if latency.p_value is not None:
            ratio = extra["median_ratio"]
            if extra["p_slower"] < CANARY_ALPHA and ratio > canary.max_latency_ratio:
                breaches.append(
                    f"latency is significantly higher (Mann-Whitney U, one-sided p = "
                    f"{extra['p_slower']:.2g}): median {check['canary']['p50_ms']:.1f} ms is "
                    f"{ratio:.2f}x the baseline's {check['baseline']['p50_ms']:.1f} ms "
                    f"(limit {canary.max_latency_ratio:g}x)"
                )
    check["latency_ratio_median"] = ratio
    at = f"at {canary.weight:g}% (step {canary.step_index + 1} of {len(canary.steps)})"
    if breaches:
        return Analysis(
            "breach", f"canary v{canary.canary_version} {at}: " + "; ".join(breaches), check
        )
    latency_note = "" if ratio is None else f", median latency ratio {ratio:.2f}"
    return Analysis("pass", f"{at}: error rate {rate:.1%}{latency_note}", check)
