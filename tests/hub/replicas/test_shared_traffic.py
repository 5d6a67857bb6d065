"""Traffic statistics and canaries across three replicas: every replica's readout adds up the
traffic that went through all of them, a canary's steps count every replica's requests, one
replica analyses it and runs its validation gate, and when that replica is killed with
SIGKILL mid-canary another continues from the recorded step; the usage metered for the model
still equals what every client was told, the killed replica's included.

Uses the package's shared cluster (conftest.py) and a model of its own, `ts-emb`."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from benchmarks.launch.cluster import Cluster, Replica, wait_for
from tests.hub.replicas.conftest import CANARY_LEASE

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.serial]

MODEL = "ts-emb"
_keys = itertools.count()
# What this module's clients of MODEL were told: answers, and prompt tokens in their `usage`.
TOLD = {"requests": 0, "prompt_tokens": 0}


def ok(r: httpx.Response) -> Any:
    assert r.status_code < 300, r.text
    return r.json()


def embed(replica: Replica) -> str:
    """One routed request (a fresh sticky key) served by `replica`; the version that served.
    Every replica serves its share itself (as a model resident on all of them would): the
    signed hop headers a forwarding peer sets keep placement from sending it all to one
    holder."""
    r = replica.post_here("/v1/embeddings", {"model": MODEL, "input": ["a b c"],
                                             "user": f"u-{next(_keys)}"})  # fmt: skip
    assert r.status_code == 200, r.text
    TOLD["requests"] += 1
    TOLD["prompt_tokens"] += r.json()["usage"]["prompt_tokens"]
    return r.headers["X-Hub-Model-Version"]


def readout(replica: Replica) -> dict[str, Any]:
    doc: dict[str, Any] = ok(replica.get(f"/admin/traffic/{MODEL}/readout"))
    return doc


def total(doc: dict[str, Any]) -> int:
    return sum(v["requests"] for v in doc["versions"])


def replica_ids(cluster: Cluster) -> dict[str, Replica]:
    """Each replica by the id it answers with (its own, whether or not its last heartbeat is
    still fresh on a loaded machine)."""
    return {ok(r.get("/admin/replicas"))["this_replica"]: r for r in cluster.replicas}


def fleet_whole(cluster: Cluster) -> bool:
    """Every replica lists all of them live (each one's heartbeat fresh). A 503 (the
    database slow to answer on a loaded machine) is a "not yet"."""
    answers = [r.get("/admin/replicas") for r in cluster.replicas]
    if any(a.status_code != 200 for a in answers):
        return False
    ids = {a.json()["this_replica"] for a in answers}
    listed = [{r["id"] for r in a.json()["replicas"]} for a in answers]
    return len(ids) == len(cluster.replicas) and all(seen == ids for seen in listed)


def canary(replica: Replica) -> dict[str, Any]:
    doc: dict[str, Any] = ok(replica.get(f"/admin/traffic/{MODEL}/canary"))
    return doc


def analyst(cluster: Cluster) -> str | None:
    with cluster.engine.connect() as conn:
        holder: str | None = conn.execute(
            text("SELECT holder FROM hub_leases WHERE name = :n"), {"n": f"canary:{MODEL}"}
        ).scalar()
    return holder


@pytest.fixture(scope="module")
def two_versions(cluster: Cluster, tiny_embedder_dir: Path, tiny_embedder_v2_dir: Path) -> None:
    first = cluster.replicas[0]
    for source, aliases in ((tiny_embedder_dir, ["production"]), (tiny_embedder_v2_dir, [])):
        ok(first.post("/admin/registry/models", json={"name": MODEL, "kind": "embedder",
                                                      "source": str(source),
                                                      "aliases": aliases}))  # fmt: skip
    for replica in cluster.replicas:  # every catalog has read both versions (one poll)
        wait_for(
            lambda r=replica: r.get(f"/v1/models/{MODEL}@2").status_code == 200,
            f"{replica.base} never listed {MODEL}@2",
        )


def test_every_replica_reads_the_traffic_of_all(cluster: Cluster, two_versions: None) -> None:
    first = cluster.replicas[0]
    halves = [{"version": 1, "weight": 50}, {"version": 2, "weight": 50}]
    ok(first.put(f"/admin/traffic/{MODEL}", json={"splits": halves}))
    for replica in cluster.replicas:  # each serves the split once its catalog has it
        wait_for(lambda r=replica: embed(r) == "2", f"{replica.base} never applied the split")
    # Settled: every replica's readout agrees once the probes above are flushed.
    wait_for(lambda: len({total(readout(r)) for r in cluster.replicas}) == 1, "never settled")
    before = total(readout(first))

    per_replica = 30
    served = {"1": 0, "2": 0}
    for _ in range(per_replica):
        for replica in cluster.replicas:
            served[embed(replica)] += 1
    expected = before + per_replica * len(cluster.replicas)
    for replica in cluster.replicas:
        wait_for(lambda r=replica: total(readout(r)) == expected,
                 f"{replica.base}'s readout never showed all {expected} requests")  # fmt: skip
        doc = readout(replica)
        assert len(doc["replicas"]) == 3 and "every replica" in doc["scope"]
        counts = {v["version"]: v["requests"] for v in doc["versions"]}
        assert counts["1"] >= served["1"] and counts["2"] >= served["2"]
        assert doc["comparisons"][0]["latency"]["test"] == "Mann-Whitney U"
    ok(first.delete(f"/admin/traffic/{MODEL}"))


def test_one_analyst_runs_the_canary_and_another_takes_over(
    cluster: Cluster, two_versions: None
) -> None:
    first = cluster.replicas[0]
    ok(first.post(f"/admin/registry/models/{MODEL}/versions/2/promote", json={"to": "staging"}))
    # Loose latency limit: three replicas on two busy cores; latency has its own tests.
    ok(first.post(f"/admin/traffic/{MODEL}/canary",
                  json={"version": 2, "steps": [50, 100], "interval": "1s",
                        "min_requests": 20, "max_latency_ratio": 20}))  # fmt: skip
    by_id = replica_ids(cluster)
    alive = list(cluster.replicas)

    def traffic_until(condition: Any, what: str) -> None:
        def step() -> bool:
            for replica in alive:
                embed(replica)
            return bool(condition())

        wait_for(step, what, within=180)

    traffic_until(lambda: canary(first)["step_index"] == 1, "the first step never passed")
    check = canary(first)["last_check"]
    # The step was decided on every replica's traffic, summed.
    assert len(check["replicas"]) == 3, check
    assert check["canary"]["requests"] >= 20

    holder = analyst(cluster)
    assert holder in by_id
    victim = by_id[holder]
    victim.kill()  # mid-canary, no goodbye: its lease stays until it expires
    alive.remove(victim)
    survivor = alive[0]
    traffic_until(lambda: canary(survivor)["state"] != "running",
                  f"no replica continued the canary after its {CANARY_LEASE}s lease")  # fmt: skip
    done = canary(survivor)
    assert done["state"] == "promoted", done
    assert analyst(cluster) in {i for i, r in by_id.items() if r is not victim} | {None}

    events = ok(survivor.get("/admin/registry/events", params={"model": MODEL}))
    production = [e for e in events if e["alias"] == "production" and e["version"] == 2]
    assert [e["action"] for e in production] == ["promote"]  # one gate, one promotion
    assert production[0]["validation"]["passed"] is True
    assert not [e for e in events if e["action"] == "rollback"]
    # Usage is committed before each answer: the victim's survived it, per key and model
    # (one caller here: auth is off in this cluster, every request is "anonymous"'s).
    r = survivor.get("/admin/usage", params={"model": MODEL, "group_by": "key,model"})
    [metered] = ok(r)
    assert (metered["key"], metered["model"]) == ("anonymous", MODEL)
    assert {k: metered[k] for k in TOLD} == TOLD
    victim.restart()
    wait_for(lambda: fleet_whole(cluster), "the killed replica never came back")
