"""The per-version readout of a model's traffic: `GET /admin/traffic/{name}/readout`.

For each version: requests, errors, latency percentiles of successful requests, tokens per
second; then a sample-ratio check of the routed counts against the split, and each version
compared with the baseline (production when it takes part, else the heaviest arm): error
rates by a two-proportion z-test, latency by Mann-Whitney U. The window is the samples this
hub process has seen since it applied the model's current traffic policy (bounded by
`traffic.sample_window` per version); other replicas keep their own.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from hub.routing.assignment import Arm, AssignmentTable
from hub.traffic.shadow import ShadowMirror
from hub.traffic.significance import (
    mann_whitney,
    percentiles,
    sample_ratio,
    two_proportions,
)
from hub.traffic.stats import Sample, ShadowSample, TrafficStats
from registry.views import ModelView, TrafficPolicyView

SCOPE = (
    "this hub process, since it applied the model's current traffic policy "
    "(replicas keep their own windows; a restart starts empty)"
)


@dataclass(frozen=True)
class ArmSummary:
    label: str
    requests: int
    routed: int
    errors: int
    latencies: list[float]  # seconds, successful requests
    tokens: int

    @classmethod
    def of(cls, label: str, samples: list[Sample]) -> ArmSummary:
        ok = [s for s in samples if not s.error]
        return cls(
            label=label,
            requests=len(samples),
            routed=sum(1 for s in samples if s.routed),
            errors=len(samples) - len(ok),
            latencies=[s.latency_s for s in ok],
            tokens=sum(s.tokens for s in ok),
        )

    def as_dict(self, weight: float, share: float | None) -> dict[str, Any]:
        busy = sum(self.latencies)
        ms = {
            k: None if v is None else round(v * 1000, 3)
            for k, v in percentiles(self.latencies).items()
        }
        return {
            "version": self.label,
            "weight": weight,
            "bucket_share": None if share is None else round(share * 100, 2),
            "requests": self.requests,
            "routed": self.routed,
            "errors": self.errors,
            "error_rate": round(self.errors / self.requests, 6) if self.requests else None,
            "latency_ms": ms,
            "tokens": self.tokens,
            "tokens_per_second": round(self.tokens / busy, 2) if busy > 0 else None,
        }


def effective_splits(view: ModelView, policy: TrafficPolicyView | None) -> dict[str, float]:
    """{version label: weight} of what is served: the stored split, or 100% to the default."""
    if policy is not None and any(s.weight > 0 for s in policy.splits):
        return {Arm(s.model, s.version).label(view.name): s.weight for s in policy.splits}
    default = view.default_version()
    return {str(default): 100.0} if default is not None else {}


def _baseline(view: ModelView, weights: dict[str, float], arms: dict[str, ArmSummary]) -> str:
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
    stats: TrafficStats,
    mirror: ShadowMirror,
    *,
    min_samples: int,
    canary: dict[str, Any] | None = None,
) -> dict[str, Any]:
    name = view.name
    epoch = stats.epoch(name)
    weights = effective_splits(view, policy)
    shares = (
        {arm.label(name): share for arm, share in table.shares().items()}
        if table is not None
        else dict.fromkeys(weights, 1.0)
    )
    arms: dict[str, ArmSummary] = {}
    truncated = False
    for label in sorted({*weights, *stats.labels(name)}, key=_label_order):
        window = stats.since(name, label, epoch)
        truncated |= window.truncated
        arms[label] = ArmSummary.of(label, window.samples)
    doc: dict[str, Any] = {
        "model": name,
        "kind": view.kind,
        "scope": SCOPE,
        "window_truncated": truncated,
        "policy_revision": policy.revision if policy is not None else 0,
        "versions": [a.as_dict(weights.get(lb, 0.0), shares.get(lb)) for lb, a in arms.items()],
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
            if label == base.label:
                continue
            doc["comparisons"].append(
                {
                    "version": label,
                    "baseline": base.label,
                    "error_rate": two_proportions(
                        arm.errors, arm.requests, base.errors, base.requests, min_n=min_samples
                    ).as_dict(),
                    "latency": mann_whitney(
                        arm.latencies, base.latencies, min_n=min_samples
                    ).as_dict(),
                }
            )
    doc["shadow"] = shadow_summary(name, stats, mirror, policy)
    doc["canary"] = canary
    return doc


def _label_order(label: str) -> tuple[int, str]:
    return (0, f"{int(label):012d}") if label.isdigit() else (1, label)
