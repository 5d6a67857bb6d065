"""Usage metered by several replicas on one PostgreSQL: embeddings and rerank answered by two
replicas add up, per key and model, to what their clients were told, and any replica reads
the sum. (A replica killed with SIGKILL mid-run keeps its usage: test_shared_traffic.py.)

Uses the package's shared cluster (conftest.py) and its configured `emb` and `rerank`; other
modules meter those too, so this test compares what its own requests added."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.launch.cluster import Cluster, Replica

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.serial]

DOCUMENTS = ["a cat sat on the mat", "stock prices fell", "the kitten slept"]


def usage(replica: Replica) -> dict[tuple[str, str], dict[str, Any]]:
    r = replica.get("/admin/usage", params={"group_by": "key,model"})
    assert r.status_code == 200, r.text
    return {(row["key"], row["model"]): row for row in r.json()}


def added(before: dict[str, Any] | None, after: dict[str, Any], field: str) -> int:
    return int(after[field] - (before[field] if before else 0))


def test_usage_of_two_replicas_adds_up(cluster: Cluster) -> None:
    first, second, reader = cluster.replicas
    before = usage(reader)
    told = {"emb": [0, 0], "rerank": [0, 0]}  # requests, prompt tokens
    for i in range(6):
        replica = (first, second)[i % 2]
        r = replica.post_here("/v1/embeddings", {"model": "emb", "input": [f"text {i}", "b"]})
        assert r.status_code == 200, r.text
        told["emb"][0] += 1
        told["emb"][1] += r.json()["usage"]["prompt_tokens"]
        r = replica.post_here(
            "/v1/rerank", {"model": "rerank", "query": f"cat {i}", "documents": DOCUMENTS}
        )
        assert r.status_code == 200, r.text
        told["rerank"][0] += 1
        told["rerank"][1] += r.json()["usage"]["prompt_tokens"]
    # Committed before each answer: the third replica reads every row at once.
    after = usage(reader)
    for model, (requests, tokens) in told.items():
        key = ("anonymous", model)
        assert added(before.get(key), after[key], "requests") == requests
        assert added(before.get(key), after[key], "prompt_tokens") == tokens
    emb = ("anonymous", "emb")
    assert added(before.get(emb), after[emb], "embedded_inputs") == 12
    rerank = ("anonymous", "rerank")
    assert added(before.get(rerank), after[rerank], "rerank_documents") == 18
