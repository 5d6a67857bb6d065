"""The per-version readout of a model's traffic: `GET /admin/traffic/{name}/readout`.

For each version: requests, errors, latency percentiles of successful requests, tokens per
second; then a sample-ratio check of the routed counts against the split, and each version
compared with the baseline (production when it takes part, else the heaviest arm): error
rates by a two-proportion z-test, latency by Mann-Whitney U on the latency histograms (the
canary's test too). The window is the model's current traffic-policy revision, summed over
every replica (hub.traffic.shared): `replicas` lists those that contributed. Shadow figures
are this process's.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hub.routing.assignment import Arm, AssignmentTable
from hub.traffic.histogram import Tally
from hub.traffic.shadow import ShadowMirror
from hub.traffic.shared import Totals
from hub.traffic.significance import (
    mann_whitney,
    percentiles,
    sample_ratio,
    two_proportions,
)
from hub.traffic.stats import ShadowSample, TrafficStats
from registry.views import ModelView, TrafficPolicyView

SCOPE = (
    "every replica, since the model's current traffic policy (its revision) was applied; "
    "other replicas' numbers lag by at most one statistics flush"
)
LOCAL_SCOPE = (
    "this replica only, since the model's current traffic policy: the database did not "
    "answer, so other replicas' numbers are missing"
)


def arm_summary(label: str, tally: Tally, weight: float, share: float | None) -> dict[str, Any]:
    """One version's row of the readout."""
    ms = {
        k: None if v is None else round(v * 1000, 3) for k, v in tally.latency.percentiles().items()
    }
    return {
        "version": label,
        "weight": weight,
        "bucket_share": None if share is None else round(share * 100, 2),
        "requests": tally.requests,
        "routed": tally.routed,
        "errors": tally.errors,
        "error_rate": round(tally.errors / tally.requests, 6) if tally.requests else None,
        "latency_ms": ms,
        "tokens": tally.tokens,
        "tokens_per_second": round(tally.tokens / tally.busy_s, 2) if tally.busy_s > 0 else None,
    }


def effective_splits(view: ModelView, policy: TrafficPolicyView | None) -> dict[str, float]:
    """{version label: weight} of what is served: the stored split, or 100% to the default."""
    if policy is not None and any(s.weight > 0 for s in policy.splits):
        return {Arm(s.model, s.version).label(view.name): s.weight for s in policy.splits}
    default = view.default_version()
    return {str(default): 100.0} if default is not None else {}


def _baseline(view: ModelView, weights: dict[str, float], arms: dict[str, Tally]) -> str:
    production = view.aliases.get("production")
    if production is not None and str(production) in arms:
        return str(production)
    ranked = sorted(arms, key=lambda label: (-weights.get(label, 0.0), label))
    return ranked[0]


def shadow_summary(
    model: str, stats: TrafficStats, mirror: ShadowMirror, policy: TrafficPolicyView | None
) -> dict[str, Any] | None:
    labels = stats.shadow_labels(model)
    current = policy.shadow if policy is not None else None
    if current is None and not labels:
        return None
    out: dict[str, Any] = {
        "target": None
        if current is None
        else {
            "version": Arm(current.model, current.version).label(model),
            "percent": current.percent,
        },
        "queued": mirror.queued,
        "versions": [],
    }
    outcomes = Counter(
        {(label, o): n for (m, label, o), n in mirror.outcomes.items() if m == model}
    )
    for label in sorted({*labels, *(lb for lb, _ in outcomes)}):
        samples = stats.shadow_since(model, label, stats.epoch(model))
        out["versions"].append(_shadow_arm(label, samples, outcomes))
    return out


def _shadow_arm(
    label: str, samples: list[ShadowSample], outcomes: Counter[tuple[str, str]]
) -> dict[str, Any]:
    ok = [s for s in samples if s.error is None]
    sims = [s.similarity for s in ok if s.similarity is not None]
    ratios = [s.latency_s / s.primary_latency_s for s in ok if s.primary_latency_s > 0]
    errors = [s.error for s in samples if s.error is not None]

    def ms(values: list[float]) -> dict[str, float | None]:
        return {
            k: None if v is None else round(v * 1000, 3) for k, v in percentiles(values).items()
        }

    return {
        "version": label,
        "mirrored": len(samples),
        "errors": len(errors),
        "last_error": errors[-1] if errors else None,
        # Since the process started (drops happen before a sample exists).
        "outcomes": {o: n for (lb, o), n in sorted(outcomes.items()) if lb == label},
        "similarity": {
            "mean": round(sum(sims) / len(sims), 6) if sims else None,
            "min": round(min(sims), 6) if sims else None,
            "compared": len(sims),
        },
        "latency_ms": ms([s.latency_s for s in ok]),
        "primary_latency_ms": ms([s.primary_latency_s for s in ok]),
        "latency_ratio_p50": round(percentiles(ratios)["p50"] or 0, 4) if ratios else None,
    }


def build_readout(
    view: ModelView,
    policy: TrafficPolicyView | None,
    table: AssignmentTable | None,
    totals: Totals,
    stats: TrafficStats,
    mirror: ShadowMirror,
    *,
    min_samples: int,
    canary: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The readout of `view` from `totals` (its current revision, every replica's)."""
    name = view.name
    weights = effective_splits(view, policy)
    shares = (
        {arm.label(name): share for arm, share in table.shares().items()}
        if table is not None
        else dict.fromkeys(weights, 1.0)
    )
    arms = {
        label: totals.arm(label) for label in sorted({*weights, *totals.labels()}, key=_label_order)
    }
    doc: dict[str, Any] = {
        "model": name,
        "kind": view.kind,
        "scope": SCOPE if totals.shared else LOCAL_SCOPE,
        "replicas": totals.replicas,
        "window_truncated": False,  # histograms keep every request of the window
        "policy_revision": totals.revision,
        "versions": [
            arm_summary(lb, a, weights.get(lb, 0.0), shares.get(lb)) for lb, a in arms.items()
        ],
    }
    routed = {label: a.routed for label, a in arms.items()}
    if table is not None:
        doc["sample_ratio"] = sample_ratio(routed, shares).as_dict()
        doc["sample_ratio"]["intended_weights"] = weights
    else:
        doc["sample_ratio"] = {
            "test": "chi-square sample-ratio",
            "status": "n/a",
            "detail": "no split: the default version serves all traffic",
        }
    with_data = {label: a for label, a in arms.items() if a.requests}
    doc["baseline"] = _baseline(view, weights, with_data) if with_data else None
    doc["comparisons"] = []
    if doc["baseline"] is not None:
        base = with_data[doc["baseline"]]
        for label, arm in with_data.items():
            if label == doc["baseline"]:
                continue
            doc["comparisons"].append(
                {
                    "version": label,
                    "baseline": doc["baseline"],
                    "error_rate": two_proportions(
                        arm.errors, arm.requests, base.errors, base.requests, min_n=min_samples
                    ).as_dict(),
                    "latency": mann_whitney(arm.latency, base.latency, min_n=min_samples).as_dict(),
                }
            )
    doc["shadow"] = shadow_summary(name, stats, mirror, policy)
    doc["canary"] = canary
    return doc


def _label_order(label: str) -> tuple[int, str]:
    return (0, f"{int(label):012d}") if label.isdigit() else (1, label)
