"""Prometheus series of grammar compilation, labelled by `model` and `version`.

Created once per registry and shared by every engine on it, as `backends.llm.metrics` does.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

_COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


@dataclass(frozen=True)
class _Series:
    compile_seconds: Histogram
    cache_hits: Counter
    cache_misses: Counter


_series_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, _Series] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


def _series(registry: CollectorRegistry) -> _Series:
    labels = ["model", "version"]
    with _lock:
        series = _series_by_registry.get(registry)
        if series is None:
            series = _series_by_registry[registry] = _Series(
                Histogram(
                    "hub_llm_grammar_compile_seconds",
                    "Compiling a structured-output grammar (cache misses only)",
                    labels,
                    buckets=_COMPILE_BUCKETS,
                    registry=registry,
                ),
                Counter(
                    "hub_llm_grammar_cache_hits",
                    "Structured-output requests whose grammar was already compiled",
                    labels,
                    registry=registry,
                ),
                Counter(
                    "hub_llm_grammar_cache_misses",
                    "Structured-output requests that compiled their grammar",
                    labels,
                    registry=registry,
                ),
            )
        return series


class GrammarMetrics:
    """One engine's grammar series; records nothing without a registry. Also counts in
    plain attributes, which tests and the benchmark read."""

    def __init__(self, registry: CollectorRegistry | None, model: str, version: str) -> None:
        self.hits = 0
        self.misses = 0
        self.compile_seconds = 0.0
        self._series = _series(registry) if registry is not None else None
        self._labels = (model, version)

    def observe_compile(self, seconds: float) -> None:
        self.misses += 1
        self.compile_seconds += seconds
        if self._series is not None:
            self._series.compile_seconds.labels(*self._labels).observe(seconds)
            self._series.cache_misses.labels(*self._labels).inc()

    def observe_hit(self) -> None:
        self.hits += 1
        if self._series is not None:
            self._series.cache_hits.labels(*self._labels).inc()
