"""One hub cluster for every multi-replica test of this package: a throwaway PostgreSQL, one
MLflow server and three `hub serve` replicas started at the same instant on the empty database.

Starting it costs tens of seconds on two cores, so it is package-scoped and shared: each test
uses its own model names, and a test that kills a replica or MLflow brings it back before it
ends (see benchmarks/launch/cluster.py). Models every test may rely on are configured here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.launch.cluster import Cluster, running_cluster
from benchmarks.launch.postgres import PostgresUnavailable
from benchmarks.launch.round_robin import (
    PLACEMENT_MODELS,
    build_placement_embedder,
    placement_budget,
)

HEARTBEAT, EXPIRE = 0.5, 2.0
CANARY_LEASE = 2.0


def cluster_config(
    tiny_embedder_dir: Path, tiny_reranker_dir: Path, placement_embedder_dir: Path
) -> dict[str, Any]:
    placement_models = [
        {"name": name, "kind": "embedder", "source": str(placement_embedder_dir)}
        for name in PLACEMENT_MODELS
    ]
    budget = placement_budget(placement_embedder_dir, tiny_embedder_dir)
    return {
        "cache_dir": ".hub/cache",  # relative: each replica in its own folder, as pods
        "devices": [{"name": "cpu", "memory_budget": budget}],
        "models": [
            {"name": "emb", "kind": "embedder", "source": str(tiny_embedder_dir),
             "aliases": ["production"]},
            {"name": "rerank", "kind": "reranker", "source": str(tiny_reranker_dir)},
            *placement_models,
        ],
        "replica": {"heartbeat_interval": HEARTBEAT, "expire_after": EXPIRE},
        # The encoders run in the hubs' own processes: these modules are about replicas
        # (routing, placement, shared statistics), and three hubs each starting a fork server
        # and workers for every load cost the suite some 40 s on two cores.
        # tests/hub/test_demo.py and tests/backends/encoders/test_forward_process.py cover the
        # workers.
        "encoder_worker_processes": False,
        # test_shared_traffic.py: statistics flushed often, canaries looked at often, a dead
        # canary analyst replaced within CANARY_LEASE.
        "traffic": {"stats_flush_interval": "200ms", "canary_tick": "200ms",
                    "canary_lease": f"{CANARY_LEASE}s"},
    }  # fmt: skip


@pytest.fixture(scope="package")
def placement_embedder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_placement_embedder(tmp_path_factory.mktemp("placement") / "embedder")


@pytest.fixture(scope="package")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_embedder_dir: Path,
    tiny_reranker_dir: Path,
    placement_embedder_dir: Path,
) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    config = cluster_config(tiny_embedder_dir, tiny_reranker_dir, placement_embedder_dir)
    try:
        with running_cluster(root, config) as c:
            yield c
    except PostgresUnavailable as e:
        pytest.skip(str(e))


# Modules that restart parts of the shared cluster (MLflow killed and started, a replica
# restarted) run after the others in this package, so those run on a cluster nothing has
# disturbed yet.
RUN_LAST = ("test_mlflow_outage.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def last(item: pytest.Item) -> bool:
        return item.path.parent == Path(__file__).parent and item.path.name in RUN_LAST

    items.sort(key=last)  # stable: every other order is kept
