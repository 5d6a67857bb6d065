"""Model-aware placement on the shared three-replica cluster: six models, each replica fits
two, requests round-robin across replicas as a load balancer sends them. After warm-up (60
requests, longer while a step of 30 still causes loads) the models stay put (at most 5% of
requests cause a load), every request succeeds, answers say
which replica served them and which version; a replica killed with SIGKILL costs no request.

Without placement the same workload reloads a model on most requests (benchmarks/placement.py
measures both)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.launch.cluster import Cluster, wait_for
from benchmarks.launch.round_robin import PLACEMENT_MODELS, embed, loads, replica_ids, round_robin
from tests.hub.replicas.conftest import EXPIRE

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.serial]

WARM_UP, MEASURED = 60, 120
SETTLE, SETTLE_STEPS = 30, 6


def _unreachable(base: str, peer: str) -> float:
    """How often `base` found `peer` unreachable (hub_forwarded_requests_total)."""
    wanted = {"peer": peer, "outcome": "unreachable"}
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "hub_forwarded_requests":
            for s in family.samples:
                if s.name.endswith("_total") and s.labels == wanted:
                    return s.value
    return 0.0


def _listed(base: str) -> int:
    return len(httpx.get(f"{base}/admin/replicas", timeout=10).json()["replicas"])


def _wait_whole(cluster: Cluster) -> None:
    for base in cluster.bases:
        wait_for(lambda b=base: _listed(b) == 3, f"{base} does not list all three replicas")


def _unload_everywhere(cluster: Cluster, *, everything: bool = False) -> None:
    """Unload this module's models from every replica (leave the cluster as found), or with
    `everything` every model: the budget holds two placement models and one small model, and
    models other modules left resident (two versions of an embedder, say) would leave room
    for one placement model on a replica, and the six would take turns there."""
    for base in cluster.bases:
        for m in httpx.get(f"{base}/admin/models", timeout=10).json():
            ours = everything or m["name"] in PLACEMENT_MODELS
            if ours and m["state"] in ("loaded", "warm"):
                httpx.post(f"{base}/admin/models/{m['name']}/versions/{m['version']}/unload",
                           timeout=60)  # fmt: skip


def _held(cluster: Cluster) -> dict[str, Any]:
    """Per replica: its devices' free bytes and the models it holds, with their state."""
    held: dict[str, Any] = {}
    for base in cluster.bases:
        models = httpx.get(f"{base}/admin/models", timeout=10).json()
        devices = httpx.get(f"{base}/admin/devices", timeout=10).json()["devices"]
        held[base] = {
            "free": [d.get("free_bytes") for d in devices],
            "models": {f"{m['name']}@{m['version']}": m["state"] for m in models
                       if m["state"] in ("loaded", "warm", "loading")},
        }  # fmt: skip
    return held


def _warm_up(cluster: Cluster) -> int:
    """WARM_UP requests, then more in steps of SETTLE until a step causes no load (at most
    SETTLE_STEPS of them): on a loaded machine heartbeats lag the requests and placement
    takes longer to settle. Returns the requests sent; the measured window follows."""
    round_robin(cluster, PLACEMENT_MODELS, WARM_UP, seed=1)
    sent = WARM_UP
    for step in range(SETTLE_STEPS):
        before = loads(cluster, PLACEMENT_MODELS)
        round_robin(cluster, PLACEMENT_MODELS, SETTLE, seed=100 + step, start=sent)
        sent += SETTLE
        if loads(cluster, PLACEMENT_MODELS) == before:
            break
    return sent


def test_six_models_on_three_replicas_stay_put(cluster: Cluster) -> None:
    _wait_whole(cluster)
    _unload_everywhere(cluster, everything=True)
    ids = replica_ids(cluster)
    try:
        warmed = _warm_up(cluster)
        before = loads(cluster, PLACEMENT_MODELS)
        answers = round_robin(cluster, PLACEMENT_MODELS, MEASURED, seed=2, start=warmed)
        caused = loads(cluster, PLACEMENT_MODELS) - before

        assert [a.status for a in answers] == [200] * MEASURED
        assert caused <= 0.05 * MEASURED, (
            f"{caused} loads in {MEASURED} requests after warm-up; held: {_held(cluster)}"
        )
        # Every answer names the version and the replica that served it; most were served
        # by another replica than the one asked (each holds two of six models).
        assert all(a.version == "1" and a.served_by in ids for a in answers)
        forwarded = [a for a in answers if a.served_by != ids[a.asked]]
        assert len(forwarded) >= MEASURED // 3
        # Each model is served by one replica, and the six are spread over all three.
        servers = {m: {a.served_by for a in answers if a.model == m} for m in PLACEMENT_MODELS}
        assert all(len(s) == 1 for s in servers.values()), servers
        assert set(Counter(next(iter(s)) for s in servers.values())) == set(ids)

        # A forwarded answer is the answer: the same vector as the serving replica's own.
        model, holder = PLACEMENT_MODELS[0], next(iter(servers[PLACEMENT_MODELS[0]]))
        other = next(i for i, rid in enumerate(ids) if rid != holder)
        with httpx.Client(timeout=60) as client:
            relayed = embed(client, cluster.bases[other], model)
            direct = embed(client, cluster.bases[ids.index(holder)], model)
        assert relayed.headers["x-hub-replica"] == holder
        assert relayed.headers["x-hub-model-version"] == "1"
        assert relayed.json()["data"] == direct.json()["data"]
        assert relayed.headers["content-type"] == "application/json"
    finally:
        _unload_everywhere(cluster)


def test_a_killed_holder_costs_no_request(cluster: Cluster) -> None:
    _wait_whole(cluster)
    ids = replica_ids(cluster)
    victim = None
    try:
        # Put every model somewhere, then kill the replica holding the first one.
        round_robin(cluster, PLACEMENT_MODELS, 30, seed=3)
        model = PLACEMENT_MODELS[0]
        with httpx.Client(timeout=60) as client:
            holder = embed(client, cluster.bases[0], model).headers["x-hub-replica"]
        victim_index = ids.index(holder)
        victim = cluster.replicas[victim_index]
        survivors = [i for i in range(3) if i != victim_index]
        victim.kill()

        # At once: the refused connection falls back (another holder, or a load here).
        with httpx.Client(timeout=120) as client:
            for _ in range(3):
                for i in survivors:
                    r = embed(client, cluster.bases[i], model)
                    assert r.status_code == 200, r.text
                    assert r.headers["x-hub-replica"] in {ids[s] for s in survivors}
        # Each survivor tried the dead replica at most once: then it left it out.
        for i in survivors:
            assert _unreachable(cluster.bases[i], holder) <= 1

        # Past one heartbeat expiry its row is gone, and traffic for all six models flows
        # among the survivors.
        wait_for(lambda: all(_listed(cluster.bases[i]) == 2 for i in survivors),
                 "the killed replica never expired", within=EXPIRE * 10)  # fmt: skip
        with httpx.Client(timeout=120) as client:
            for m in PLACEMENT_MODELS:
                for i in survivors:
                    r = embed(client, cluster.bases[i], m)
                    assert r.status_code == 200, r.text
                    assert r.headers["x-hub-replica"] != holder
    finally:
        if victim is not None:
            victim.restart()
        _wait_whole(cluster)
        _unload_everywhere(cluster)


def test_admin_calls_name_a_replica(cluster: Cluster) -> None:
    _wait_whole(cluster)
    ids = replica_ids(cluster)
    model, target = PLACEMENT_MODELS[5], ids[2]
    path = f"/admin/models/{model}/versions/1"
    try:
        # Asked at replica 0, pinned on replica 2.
        r = httpx.post(f"{cluster.bases[0]}{path}/pin", params={"replica": target}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-hub-replica"] == target and r.json()["pinned"]
        held = httpx.get(f"{cluster.bases[2]}/admin/models", timeout=10).json()
        assert any(m["name"] == model and m["pinned"] for m in held)
        elsewhere = httpx.get(f"{cluster.bases[0]}/admin/models", timeout=10).json()
        assert not any(m["name"] == model and m["pinned"] for m in elsewhere)

        r = httpx.post(f"{cluster.bases[1]}{path}/pin", params={"replica": "nobody"}, timeout=30)
        assert r.status_code == 404 and "GET /admin/replicas" in r.json()["error"]["message"]
    finally:
        httpx.post(f"{cluster.bases[1]}{path}/unload", params={"replica": target}, timeout=60)
