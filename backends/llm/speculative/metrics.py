"""Prometheus series of speculative decoding, labelled by `model` and `version`.

Created once per registry and shared by every engine on it, as `backends.llm.metrics` does.
Draft positions are labelled 1.. (the first draft after the sequence's last token is 1); a
draft at position i is only judged when the ones before it were accepted, so the acceptance
rate at i is that of reaching i + 1 given i.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

# Positions get their own label up to this one; later ones are counted under it.
MAX_POSITION_LABEL = 16


@dataclass(frozen=True)
class _Series:
    proposed: Counter
    accepted: Counter
    proposed_at: Counter
    accepted_at: Counter
    verify_steps: Counter
    emitted: Counter


_series_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, _Series] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


def _series(registry: CollectorRegistry) -> _Series:
    labels = ["model", "version"]
    at = [*labels, "position"]

    def counter(name: str, doc: str, names: list[str]) -> Counter:
        return Counter(name, doc, names, registry=registry)

    with _lock:
        series = _series_by_registry.get(registry)
        if series is None:
            series = _series_by_registry[registry] = _Series(
                counter("hub_llm_spec_draft_tokens", "Draft tokens proposed and verified", labels),
                counter("hub_llm_spec_accepted_tokens", "Draft tokens the target accepted", labels),
                counter(
                    "hub_llm_spec_draft_tokens_by_position", "Drafts verified, by position", at
                ),
                counter("hub_llm_spec_accepted_by_position", "Drafts accepted, by position", at),
                counter(
                    "hub_llm_spec_verify_steps",
                    "Sequence steps that verified drafts (one target step per sequence)",
                    labels,
                ),
                counter(
                    "hub_llm_spec_emitted_tokens",
                    "Tokens emitted by steps that verified drafts (over verify steps: tokens "
                    "per target step)",
                    labels,
                ),
            )
        return series


class SpeculationMetrics:
    """One engine's speculation series; records nothing to Prometheus without a registry,
    and always counts in plain attributes, which tests, the readout and benchmarks read."""

    def __init__(self, registry: CollectorRegistry | None, model: str, version: str) -> None:
        self.proposed = 0
        self.accepted = 0
        self.verify_steps = 0
        self.emitted = 0
        # Index i: drafts verified / accepted at position i + 1.
        self.proposed_at: list[int] = []
        self.accepted_at: list[int] = []
        self._series = _series(registry) if registry is not None else None
        self._labels = (model, version)

    def observe(self, proposed: int, accepted: int, emitted: int) -> None:
        """One sequence's step verified `proposed` drafts, kept `accepted` and emitted
        `emitted` tokens (accepted ones, the target's own, fewer at a stop)."""
        self.proposed += proposed
        self.accepted += accepted
        self.verify_steps += 1
        self.emitted += emitted
        # Drafts past the first rejected one were never judged: positions 1..accepted + 1.
        judged = min(proposed, accepted + 1)
        while len(self.proposed_at) < judged:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i in range(judged):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < accepted
        s = self._series
        if s is None:
            return
        labels = self._labels
        s.proposed.labels(*labels).inc(proposed)
        s.verify_steps.labels(*labels).inc()
        s.emitted.labels(*labels).inc(emitted)
        if accepted:
            s.accepted.labels(*labels).inc(accepted)
        for i in range(judged):
            position = str(min(i + 1, MAX_POSITION_LABEL))
            s.proposed_at.labels(*labels, position).inc()
            if i < accepted:
                s.accepted_at.labels(*labels, position).inc()

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def acceptance_by_position(self) -> list[float]:
        """Per draft position (1 first): the share of drafts judged there (every one before
        it accepted) that were accepted."""
        return [a / p for a, p in zip(self.accepted_at, self.proposed_at, strict=True)]

    @property
    def tokens_per_step(self) -> float:
        """Tokens a sequence got per target step that verified drafts."""
        return self.emitted / self.verify_steps if self.verify_steps else 0.0

    def summary(self) -> dict[str, object]:
        """The counts and rates as plain values (the readout, benchmarks' JSON)."""
        return {
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_by_position": self.acceptance_by_position(),
            "verify_steps": self.verify_steps,
            "tokens_per_step": self.tokens_per_step,
        }
