"""A key's rate limits held across replicas through PostgreSQL: a key limited to 60 requests a
minute, its requests sent all to one replica and then alternately to two, gets at most 60
(plus the bucket's refill meanwhile) plus what the second admitted before its sync heard of
the first, then 429s with OpenAI's headers on both replicas, counted over both; a key
limited in tokens a minute likewise, settled on the tokens its answers reported.

The package's cluster runs with auth off (its other modules send no keys), so the two
replicas here are hubs with auth on started in this process on the cluster's PostgreSQL and
MLflow (its configured `emb` registered there): full apps, ingress and sync included, with
no process to start. They sync every `SYNC` seconds."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from benchmarks.launch.cluster import Cluster
from hub.state import Hub
from tests.support.hubs import ADMIN, BOOTSTRAP_ADMIN_KEY, make_settings, running_app

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.serial]

SYNC = 0.25
LIMIT = 60  # requests a minute
TOKENS = 600  # tokens a minute
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


@dataclass
class Run:
    """The answers to one key's requests: first all to replica a, then alternately to a and
    b; with how many times b had read the fleet's consumption (since the alternation began)
    when each of its requests was sent."""

    first: list[httpx.Response] = field(default_factory=list)
    alternate: list[httpx.Response] = field(default_factory=list)
    b_reads: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def admitted(self) -> list[httpx.Response]:
        return [r for r in (*self.first, *self.alternate) if r.status_code == 200]

    def b_answers(self) -> list[httpx.Response]:
        return self.alternate[1::2]

    def overshoot(self) -> list[httpx.Response]:
        """b's answers admitted before its sync could have heard of a's consumption (a
        write, then a read: fewer than three reads since the alternation began). Any other
        admission, on either replica, must be the bucket's refill."""
        answers = zip(self.b_answers(), self.b_reads, strict=True)
        return [r for r, read in answers if r.status_code == 200 and read < 3]


async def exhaust_then_alternate(
    replicas: list[tuple[Hub, httpx.AsyncClient]], key: str, body: bytes, first: int
) -> Run:
    (_, to_a), (b, to_b) = replicas
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}

    async def send(client: httpx.AsyncClient) -> httpx.Response:
        r = await client.post("/v1/embeddings", content=body, headers=headers)
        assert r.status_code in (200, 429), r.text
        return r

    run = Run()
    run.first = [await send(to_a) for _ in range(first)]
    reads_before = reads(b)
    # At least 20 pairs, and on until b has read the fleet's consumption a few times since
    # the alternation began: b refuses only once it has heard of a's, and how many requests
    # that takes depends on how the machine's load delays b's sync, not on the limiter.
    deadline = time.monotonic() + 30
    while len(run.b_reads) < 20 or (reads(b) - reads_before < 4 and time.monotonic() < deadline):
        run.alternate.append(await send(to_a))
        run.b_reads.append(reads(b) - reads_before)
        run.alternate.append(await send(to_b))
    return run


def first_refusal(answers: list[httpx.Response]) -> httpx.Response:
    """The first 429 among `answers` (the bucket refills meanwhile, one request a second for
    60 a minute, so on a slow machine later answers may be admitted again)."""
    refused = [r for r in answers if r.status_code == 429]
    assert refused, f"no 429 in {len(answers)} answers"
    return refused[0]


def assert_refused(r: httpx.Response, kind: str, limit: int, cost: float) -> None:
    """A 429 in OpenAI's shape whose headers say less than `cost` of `kind` remains."""
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert r.headers[f"x-ratelimit-limit-{kind}"] == str(limit)
    assert int(r.headers[f"x-ratelimit-remaining-{kind}"]) < cost
    assert int(r.headers["retry-after"]) >= 1


async def create_key(client: httpx.AsyncClient, name: str, limits: dict[str, int]) -> str:
    body = {"name": name, "role": "user", "limits": limits}
    r = await client.post("/admin/keys", headers=ADMIN, json=body)
    assert r.status_code == 201, r.text
    key: str = r.json()["key"]
    return key


async def test_request_and_token_limits_hold_across_two_replicas(
    cluster: Cluster, tmp_path: Path
) -> None:
    async with two_replicas(cluster, tmp_path) as replicas:
        (_, to_a), (_, to_b) = replicas
        requests_key = await create_key(to_a, "rl-team", {"requests_per_minute": LIMIT})
        tokens_key = await create_key(to_a, "rl-tokens", {"tokens_per_minute": TOKENS})
        # Each replica loads `emb` before the clock starts (a load is not what is limited).
        for client in (to_a, to_b):
            r = await client.post("/v1/embeddings", json=EMBED, headers=ADMIN)
            assert r.status_code == 200, r.text

        # 60 requests a minute: all to a gives the limit (and the refill), then 429s; then b
        # admits only until it hears of a's, and refuses with the fleet's numbers: nothing
        # remaining, though b itself answered only a few.
        run = await exhaust_then_alternate(replicas, requests_key, json.dumps(EMBED).encode(),
                                           LIMIT + 10)  # fmt: skip
        assert len([r for r in run.first if r.status_code == 200]) >= LIMIT
        assert_refused(first_refusal(run.first), "requests", LIMIT, 1)
        refill = time.monotonic() - run.started + 1  # one request a second
        admitted = len(run.admitted())
        assert admitted <= LIMIT + refill + len(run.overshoot())
        assert_refused(first_refusal(run.b_answers()), "requests", LIMIT, 1)
        # The usage metered for the key is the sum of both replicas' answers.
        r = await to_b.get("/admin/usage", headers=ADMIN,
                           params={"key": "rl-team", "group_by": "key,model"})  # fmt: skip
        assert r.status_code == 200, r.text
        [row] = r.json()
        assert (row["model"], row["requests"]) == ("emb", admitted)

        # Tokens a minute: each request reserves its body's estimate and is settled on the
        # prompt tokens its answer reports; what both replicas answered stays within the
        # limit, plus the refill and b's overshoot.
        body = json.dumps({"model": "emb", "input": ["tokens " * 30]}).encode()
        cost = math.ceil(len(body) / 4)
        run = await exhaust_then_alternate(replicas, tokens_key, body, 2 * TOKENS // cost)
        assert_refused(first_refusal(run.first), "tokens", TOKENS, cost)
        used = [r.json()["usage"]["prompt_tokens"] for r in run.admitted()]
        refill = (time.monotonic() - run.started + 1) * TOKENS / 60
        assert sum(used) <= TOKENS + refill + cost * len(run.overshoot())
        assert_refused(first_refusal(run.b_answers()), "tokens", TOKENS, cost)
