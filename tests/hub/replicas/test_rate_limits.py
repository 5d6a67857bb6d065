"""A key's rate limits held across replicas through PostgreSQL: a key limited to 60 requests a
minute, its requests sent all to one replica and then alternately to two, gets at most 60
(plus the bucket's refill meanwhile) plus what the second admitted before its sync heard of
the first, then 429s with OpenAI's headers on both replicas, counted over both.

The package's cluster runs with auth off (its other modules send no keys), so the two
replicas here are hubs with auth on started in this process on the cluster's PostgreSQL and
MLflow (its configured `emb` registered there): full apps, ingress and sync included, with
no process to start. They sync every `SYNC` seconds."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from benchmarks.launch.cluster import Cluster
from hub.state import Hub
from tests.support.hubs import ADMIN, BOOTSTRAP_ADMIN_KEY, make_settings, running_app

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.serial]

SYNC = 0.25
LIMIT = 60
EMBED = {"model": "emb", "input": ["limited"]}


@contextlib.asynccontextmanager
async def two_replicas(
    cluster: Cluster, root: Path
) -> AsyncIterator[list[tuple[Hub, httpx.AsyncClient]]]:
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for name in ("rl-a", "rl-b"):
            settings = make_settings(
                root / name,
                database_url=cluster.urls["hub"],
                mlflow_tracking_uri=cluster.mlflow.url,
                auth={"enabled": True, "bootstrap_admin_key": BOOTSTRAP_ADMIN_KEY,
                      "rate_limit_sync_interval": SYNC},
                replica={"id": name, "placement": False},
            )  # fmt: skip
            app, client = await stack.enter_async_context(running_app(settings))
            out.append((app.state.hub, client))
        yield out


def reads(hub: Hub) -> float:
    """How many times `hub` has read the fleet's consumption."""
    registry: CollectorRegistry = hub.metrics.registry
    labels = {"step": "read", "outcome": "ok"}
    return registry.get_sample_value("hub_rate_limit_syncs_total", labels) or 0.0


async def send(client: httpx.AsyncClient, key: str) -> httpx.Response:
    r = await client.post("/v1/embeddings", json=EMBED, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code in (200, 429), r.text
    return r


def assert_refused(r: httpx.Response) -> None:
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert r.headers["x-ratelimit-limit-requests"] == str(LIMIT)
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(r.headers["retry-after"]) >= 1


async def test_a_request_limit_holds_across_two_replicas(cluster: Cluster, tmp_path: Path) -> None:
    async with two_replicas(cluster, tmp_path) as [(_, to_a), (b, to_b)]:
        limits = {"requests_per_minute": LIMIT}
        body = {"name": "rl-team", "role": "user", "limits": limits}
        r = await to_a.post("/admin/keys", headers=ADMIN, json=body)
        assert r.status_code == 201, r.text
        key: str = r.json()["key"]
        # Each replica loads `emb` before the clock starts (a load is not what is limited).
        for client in (to_a, to_b):
            r = await client.post("/v1/embeddings", json=EMBED, headers=ADMIN)
            assert r.status_code == 200, r.text
        started = time.monotonic()

        # All to one replica: the limit, then 429s.
        answers = [await send(to_a, key) for _ in range(LIMIT + 10)]
        first_phase = sum(r.status_code == 200 for r in answers)
        assert first_phase >= LIMIT
        assert_refused(answers[-1])

        # Then alternately to both: the second admits only until its sync hears of the first.
        reads_before = reads(b)
        alternate: list[tuple[str, httpx.Response, float]] = []
        for _ in range(20):
            for name, client in (("a", to_a), ("b", to_b)):
                read = reads(b) - reads_before
                alternate.append((name, await send(client, key), read))
        # Until b refused, b alone admits (a knows its own consumption): the overshoot.
        b_answers = [(r, read) for name, r, read in alternate if name == "b"]
        overshoot = 0
        for r, read in b_answers:
            if r.status_code == 429:
                break
            overshoot += 1
            # ...only before b's sync read what a had admitted (a write, then a read).
            assert read < 3, f"b admitted after {read:.0f} reads of the fleet's consumption"
        refill = time.monotonic() - started + 1  # the bucket refills one request a second
        admitted = first_phase + sum(r.status_code == 200 for _, r, _ in alternate)
        assert admitted <= LIMIT + refill + overshoot
        # Once it knows, b refuses with the fleet's numbers: 0 remaining, though b itself
        # answered only a few.
        assert_refused(b_answers[-1][0])

        # The usage metered for the key is the sum of both replicas' answers.
        r = await to_b.get("/admin/usage", headers=ADMIN,
                           params={"key": "rl-team", "group_by": "key,model"})  # fmt: skip
        assert r.status_code == 200, r.text
        [row] = r.json()
        assert (row["model"], row["requests"]) == ("emb", admitted)
