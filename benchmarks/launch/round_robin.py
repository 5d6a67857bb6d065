"""A round-robin embedding workload over a cluster's replicas, as a load balancer without
model awareness sends it: request i goes to replica i % N and names one of `models`, drawn
by a seeded random source; and the placement models it runs on, with the budget that holds
two of them per replica. Shared by tests/hub/replicas/test_placement.py and
benchmarks/placement.py."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.launch.cluster import Cluster

LOADS = "hub_model_loads"  # hub_model_loads_total, by its family name

# Six embedders, each charged more than any other model of the cluster, on replicas whose
# budget holds two of them plus one small model, never three of them.
PLACEMENT_MODELS = tuple(f"place-{i}" for i in range(6))


def build_placement_embedder(folder: Path) -> Path:
    """The placement models' embedder: a tiny one, wider and deeper than the default."""
    from backends.tiny import build_tiny_embedder

    return build_tiny_embedder(folder, hidden_size=256, num_layers=2, seed=13)


def placement_budget(placement_embedder_dir: Path, small_model_dir: Path) -> int:
    """Room for two placement models and one small model (emb, rerank), with the same slack
    short of a third placement model, as the manager charges them (weights plus the
    encoder's runtime reserve, which dominates the small ones)."""
    from backends.encoders.embedder import EmbedderBackend

    big = EmbedderBackend.predict_memory(placement_embedder_dir, {})
    small = EmbedderBackend.predict_memory(small_model_dir, {})
    return 2 * big + small + (big - small) // 2


@dataclass(frozen=True)
class Answer:
    """One request: which replica was asked, which served (X-Hub-Replica), the version that
    answered (X-Hub-Model-Version), the status and the client-side latency."""

    index: int
    model: str
    asked: int
    served_by: str | None
    version: str | None
    status: int
    seconds: float


def replica_ids(cluster: Cluster) -> list[str]:
    """Each replica's id, as it names itself in `/admin/replicas`."""
    ids = []
    for base in cluster.bases:
        body = httpx.get(f"{base}/admin/replicas", timeout=10).json()
        ids.append(next(r["id"] for r in body["replicas"] if r["this"]))
    return ids


def loads(cluster: Cluster, models: Iterable[str]) -> int:
    """Successful loads and restores of `models`, summed over the running replicas."""
    wanted, total = set(models), 0
    for replica in cluster.replicas:
        if replica.proc is None or replica.proc.poll() is not None:
            continue
        text = httpx.get(f"{replica.base}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            if family.name != LOADS:
                continue
            for sample in family.samples:
                labels = sample.labels
                if (sample.name.endswith("_total") and labels.get("outcome") == "ok"
                        and labels.get("model") in wanted):  # fmt: skip
                    total += int(sample.value)
    return total


def embed(client: httpx.Client, base: str, model: str) -> httpx.Response:
    return client.post(
        f"{base}/v1/embeddings", json={"model": model, "input": ["where does this go"]}
    )


def round_robin(
    cluster: Cluster,
    models: Sequence[str],
    n: int,
    *,
    seed: int = 0,
    start: int = 0,
    on_answer: Callable[[Answer], None] | None = None,
) -> list[Answer]:
    """Send `n` requests one after another (request i to replica (start + i) % N)."""
    rng = random.Random(seed)
    answers = []
    with httpx.Client(timeout=120) as client:
        for i in range(n):
            model = rng.choice(models)
            asked = (start + i) % len(cluster.replicas)
            began = time.perf_counter()
            r = embed(client, cluster.replicas[asked].base, model)
            answer = Answer(
                index=start + i,
                model=model,
                asked=asked,
                served_by=r.headers.get("x-hub-replica"),
                version=r.headers.get("x-hub-model-version"),
                status=r.status_code,
                seconds=time.perf_counter() - began,
            )
            answers.append(answer)
            if on_answer is not None:
                on_answer(answer)
    return answers
