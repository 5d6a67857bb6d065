"""Prometheus counters of metered usage, by caller (the key's name) and model, on the hub's
own registry: `hub_usage_<counter>_total{key, model}` for every counter of registry.usage,
and how the group commits went."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from registry.usage import COUNTERS, UsageCounts

# Each counter of registry.usage: its series (exported with `_total`) and help.
_SERIES = {
    "requests": ("hub_usage_requests", "Metered requests answered"),
    "errors": ("hub_usage_errors", "Metered requests answered with an error"),
    "prompt_tokens": (
        "hub_usage_prompt_tokens",
        "Tokens read (prompts, embedding inputs, rerank pairs)",
    ),
    "completion_tokens": ("hub_usage_completion_tokens", "Tokens generated"),
    "embedded_inputs": ("hub_usage_embedded_inputs", "Inputs embedded"),
    "embedded_tokens": ("hub_usage_embedded_tokens", "Tokens of the inputs embedded"),
    "rerank_documents": ("hub_usage_rerank_documents", "Documents reranked"),
}


class UsageMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.counters = {
            name: Counter(*_SERIES[name], ["key", "model"], registry=registry) for name in COUNTERS
        }
        self.commits = Counter(
            "hub_usage_commits",
            "Group commits of usage to SQL, by outcome (ok, failed)",
            ["outcome"],
            registry=registry,
        )
        self.waits_timed_out = Counter(
            "hub_usage_commit_waits_timed_out",
            "Answers sent before their usage was committed (the commit took longer than "
            "usage.commit_timeout; the counts stay queued and are written later)",
            registry=registry,
        )

        self.unwritten = Gauge(
            "hub_usage_unwritten_requests",
            "Requests whose usage is not committed yet (grows while the database fails)",
            registry=registry,
        )

    def count(self, key: str, model: str, counts: UsageCounts) -> None:
        for name, value in counts.as_dict().items():
            if value:
                self.counters[name].labels(key, model).inc(value)
