"""One hub cluster for every multi-replica test of this package: a throwaway PostgreSQL, one
MLflow server and three `hub serve` replicas started at the same instant on the empty database.

Starting it costs tens of seconds on two cores, so it is package-scoped and shared: each test
uses its own model names, and a test that kills a replica or MLflow brings it back before it
ends (see tests/support/cluster.py). Models every test may rely on are configured here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import Cluster, running_cluster

HEARTBEAT, EXPIRE = 0.5, 2.0
CANARY_LEASE = 2.0


def cluster_config(tiny_embedder_dir: Path, tiny_reranker_dir: Path) -> dict[str, Any]:
    return {
        "cache_dir": ".hub/cache",  # relative: each replica in its own folder, as pods
        "devices": [{"name": "cpu", "memory_budget": "1GiB"}],
        "models": [
            {"name": "emb", "kind": "embedder", "source": str(tiny_embedder_dir),
             "aliases": ["production"]},
            {"name": "rerank", "kind": "reranker", "source": str(tiny_reranker_dir)},
        ],
        "replica": {"heartbeat_interval": HEARTBEAT, "expire_after": EXPIRE},
        # test_shared_traffic.py: statistics flushed often, canaries looked at often, a dead
        # canary analyst replaced within CANARY_LEASE.
        "traffic": {"stats_flush_interval": "200ms", "canary_tick": "200ms",
                    "canary_lease": f"{CANARY_LEASE}s"},
    }  # fmt: skip


@pytest.fixture(scope="package")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, tiny_embedder_dir: Path, tiny_reranker_dir: Path
) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    with running_cluster(root, cluster_config(tiny_embedder_dir, tiny_reranker_dir)) as c:
        yield c
