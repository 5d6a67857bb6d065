"""Prometheus series of the LLM engine, labelled by `model` and `version`.

The series are created once per `CollectorRegistry` and shared by every engine registered on
it (a model reloaded after an eviction reuses them rather than registering twice); each engine
binds its own labels. Without a registry, `EngineMetrics.disabled()` records nothing.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from backends.llm.speculative.metrics import SpeculationMetrics
from backends.shed_metrics import ShedMetrics

# Token latencies on CPU range from milliseconds to seconds.
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
# Waiting (queue, first token) can reach the request scale under load.
_WAIT_BUCKETS = (*_TOKEN_BUCKETS, 10, 20, 40, 80, 160)


@dataclass(frozen=True)
class _Series:
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue: Histogram
    running: Gauge
    waiting: Gauge
    kv_usage: Gauge
    prefix_queries: Counter
    prefix_hits: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    preemptions: Counter
    lora_slots: Gauge
    lora_slot_loads: Counter
    fused_steps: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> _Series:
        labels = ["model", "version"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        return cls(
            ttft=hist(
                "hub_llm_time_to_first_token_seconds", "Arrival to first token", _WAIT_BUCKETS
            ),
            itl=hist(
                "hub_llm_inter_token_latency_seconds",
                "Between consecutive tokens of a sequence",
                _TOKEN_BUCKETS,
            ),
            e2e=hist(
                "hub_llm_e2e_request_latency_seconds", "Arrival to last token", _REQUEST_BUCKETS
            ),
            queue=hist(
                "hub_llm_queue_time_seconds", "Arrival to first scheduled step", _WAIT_BUCKETS
            ),
            running=gauge("hub_llm_running_sequences", "Sequences in the running batch"),
            waiting=gauge("hub_llm_waiting_sequences", "Sequences waiting to be scheduled"),
            kv_usage=gauge("hub_llm_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use"),
            prefix_queries=counter(
                "hub_llm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
            ),
            prefix_hits=counter(
                "hub_llm_prefix_cache_hits", "Prompt tokens found in the prefix cache"
            ),
            prompt_tokens=counter("hub_llm_prompt_tokens", "Prompt tokens received"),
            generation_tokens=counter("hub_llm_generation_tokens", "Tokens generated"),
            preemptions=counter("hub_llm_preemptions", "Sequences preempted for KV blocks"),
            lora_slots=gauge("hub_llm_lora_slots_in_use", "LoRA adapters in device slots"),
            lora_slot_loads=counter(
                "hub_llm_lora_slot_loads", "LoRA adapters copied from host memory into a slot"
            ),
            # The CPU's fused step runs on all its threads or half (backends/llm/fused/
            # threads.py): steps on fewer mean the machine was contended.
            fused_steps=Counter(
                "hub_llm_fused_steps",
                "Fused CPU steps run, by the threads each ran on",
                [*labels, "threads"],
                registry=registry,
            ),
        )


_series_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, _Series] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


def _series(registry: CollectorRegistry) -> _Series:
    with _lock:
        series = _series_by_registry.get(registry)
        if series is None:
            series = _series_by_registry[registry] = _Series.create(registry)
        return series


class EngineMetrics:
    """One engine's view of the series (its labels bound); every method is cheap."""

    def __init__(self, registry: CollectorRegistry | None, model: str, version: str) -> None:
        self.enabled = registry is not None
        # Speculative decoding: proposed, accepted, by position, tokens per target step.
        self.speculation = SpeculationMetrics(registry, model, version)
        if registry is None:
            return
        s = _series(registry)
        self._series = s
        self.labels = (model, version)
        self.ttft = s.ttft.labels(model, version)
        self.itl = s.itl.labels(model, version)
        self.e2e = s.e2e.labels(model, version)
        self.queue = s.queue.labels(model, version)
        self.running = s.running.labels(model, version)
        self.waiting = s.waiting.labels(model, version)
        self.kv_usage = s.kv_usage.labels(model, version)
        self.prefix_queries = s.prefix_queries.labels(model, version)
        self.prefix_hits = s.prefix_hits.labels(model, version)
        self.prompt_tokens = s.prompt_tokens.labels(model, version)
        self.generation_tokens = s.generation_tokens.labels(model, version)
        self.preemptions = s.preemptions.labels(model, version)
        self.lora_slots = s.lora_slots.labels(model, version)
        self.lora_slot_loads = s.lora_slot_loads.labels(model, version)
        self._fused_steps: dict[int, Counter] = {}
        self.shed = ShedMetrics(registry, model, version)

    @classmethod
    def disabled(cls) -> EngineMetrics:
        return cls(None, "", "")

    def observe_step(
        self,
        *,
        running: int,
        waiting: int,
        kv_usage: float,
        prefix_queries: int,
        prefix_hits: int,
        generated: int,
        preempted: int,
        lora_slots: int = 0,
        lora_slot_loads: int = 0,
    ) -> None:
        if not self.enabled:
            return
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        if prefix_queries:
            self.prefix_queries.inc(prefix_queries)
        if prefix_hits:
            self.prefix_hits.inc(prefix_hits)
        if generated:
            self.generation_tokens.inc(generated)
        if preempted:
            self.preemptions.inc(preempted)
        self.lora_slots.set(lora_slots)
        if lora_slot_loads:
            self.lora_slot_loads.inc(lora_slot_loads)

    def observe_fused_step(self, threads: int) -> None:
        """A fused CPU step ran on `threads` threads."""
        if not self.enabled:
            return
        child = self._fused_steps.get(threads)
        if child is None:
            model, version = self.labels
            child = self._fused_steps[threads] = self._series.fused_steps.labels(
                model, version, str(threads)
            )
        child.inc()

    def observe_arrival(self, prompt_tokens: int) -> None:
        if self.enabled:
            self.prompt_tokens.inc(prompt_tokens)

    def observe_shed(self, reason: str) -> None:
        """A request was refused before queueing (`queue_full` or `queue_time`)."""
        if self.enabled:
            self.shed.observe(reason)

    def observe_latency(self, series: str, seconds: float) -> None:
        """`series`: "ttft", "itl", "e2e" or "queue"."""
        if self.enabled:
            getattr(self, series).observe(seconds)

    def reset_gauges(self) -> None:
        """An unloaded engine holds nothing: its gauges read zero."""
        if self.enabled:
            self.running.set(0)
            self.waiting.set(0)
            self.kv_usage.set(0)
            self.lora_slots.set(0)
