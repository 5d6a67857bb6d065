"""Traffic policies through the API: validation, sticky routing, bypasses, readouts, faults."""

from __future__ import annotations

from pathlib import Path

from hub.routing.assignment import bucket_of
from tests.support.traffic_hub import TrafficHub, embed, register, versions


async def test_policy_is_replaced_whole_and_bad_ones_are_400(
    two_versions: TrafficHub, tiny_reranker_dir: Path
) -> None:
    t = two_versions
    await register(t.client, "rr", tiny_reranker_dir, kind="reranker")
    r = await t.client.get("/admin/traffic/emb")
    assert r.status_code == 200
    default = r.json()
    assert default["default"] is True and default["revision"] == 0
    assert [(s["version"], s["weight"]) for s in default["splits"]] == [(1, 100.0)]

    refusals = [
        ({"splits": [{"version": 1, "weight": 90}, {"version": 2, "weight": 20}]},
         "weights must sum to 100, not 90 + 20 = 110"),
        ({"splits": [{"version": 1, "weight": 50}, {"version": 9, "weight": 50}]},
         "splits[1]: model emb has no version 9 (versions: 1, 2)"),
        ({"splits": [{"version": 1, "weight": 50}, {"model": "rr", "version": 1, "weight": 50}]},
         "rr is a reranker but emb is an embedder"),
        ({"splits": [{"version": 1, "weight": 100}], "shadow": {"version": 3, "percent": 10}},
         "shadow: model emb has no version 3"),
    ]  # fmt: skip
    for body, message in refusals:
        r = await t.put(body)
        assert r.status_code == 400, r.text
        assert message in r.json()["error"]["message"]
    assert (await t.put({"splits": []})).status_code == 400
    r = await t.put({"splits": [{"version": 1, "weight": 100}]}, model="ghost")
    assert r.status_code == 404 and "not registered" in r.json()["error"]["message"]
    assert (await t.client.get("/admin/traffic/emb")).json()["revision"] == 0  # nothing moved

    r = await t.put(
        {"splits": [{"version": 1, "weight": 90}, {"version": 2, "weight": 10}],
         "shadow": {"version": 2, "percent": 5},
         "faults": [{"version": 2, "error_percent": 1, "delay_ms": 2}]}
    )  # fmt: skip
    assert r.status_code == 200, r.text
    policy = r.json()
    assert policy["default"] is False and policy["revision"] == 1
    shares = {s["label"]: s["bucket_share"] for s in policy["splits"]}
    assert abs(shares["1"] - 90) < 1.5 and abs(shares["2"] - 10) < 1.5
    assert policy["shadow"] == {"version": 2, "percent": 5.0, "model": "emb"}
    assert policy["faults"] == [{"version": 2, "error_percent": 1.0, "delay_ms": 2.0,
                                 "model": "emb"}]  # fmt: skip

    r = await t.client.delete("/admin/traffic/emb")
    assert r.status_code == 200
    cleared = r.json()
    assert cleared["default"] is True and cleared["shadow"] is None and cleared["faults"] == []

    # Both changes are in the audit log, newest first; the refusals left no trace, and the
    # alias history is untouched.
    events = (await t.client.get("/admin/registry/events", params={"model": "emb"})).json()
    traffic = [(e["action"], e["reason"]) for e in events if e["action"] == "traffic"]
    assert traffic == [
        ("traffic", "default split (everything to production)"),
        ("traffic", "split v1 90%, v2 10%; shadow v2 5%; faults v2 1% errors + 2 ms"),
    ]
    assert (await t.client.get("/v1/models")).json()["data"][0]["aliases"] == {"production": 1}


async def test_routing_is_sticky_per_key_and_names_can_bypass_it(two_versions: TrafficHub) -> None:
    t = two_versions
    assert (await t.put({"splits": [{"version": 1, "weight": 50},
                                    {"version": 2, "weight": 50}]})).status_code == 200  # fmt: skip
    table = t.hub.router.table("emb")
    assert table is not None
    seen: dict[str, set[str]] = {}
    for key in [f"user-{i}" for i in range(24)]:
        for _ in range(3):
            r = await embed(t.client, key=key)
            assert r.status_code == 200, r.text
            seen.setdefault(key, set()).add(r.headers["X-Hub-Model-Version"])
        # The version is the one the assignment table gives the key's bucket.
        assert seen[key] == {str(table.arm(bucket_of("emb", key)).version)}
    assert set().union(*seen.values()) == {"1", "2"}  # both versions serve someone

    # OpenAI's `user` is a routing key too.
    body = {"model": "emb", "input": "hi", "user": "user-3"}
    r = await t.client.post("/v1/embeddings", json=body)
    assert {r.headers["X-Hub-Model-Version"]} == seen["user-3"]

    # name@version, name@alias and /versions/{v}/ bypass the split.
    for _ in range(6):
        assert (await embed(t.client, "emb@1")).headers["X-Hub-Model-Version"] == "1"
        assert (await embed(t.client, "emb@production")).headers["X-Hub-Model-Version"] == "1"
        r = await t.client.post("/models/emb/versions/2/embed", json={"input": ["x"]})
        assert r.headers["X-Hub-Model-Version"] == "2"
    readout = await t.readout()
    rows = versions(readout)
    assert rows["1"]["routed"] + rows["2"]["routed"] == 24 * 3 + 1
    assert rows["1"]["requests"] - rows["1"]["routed"] == 12  # the pinned ones, not routed


async def test_a_split_across_model_families_names_model_at_version(
    two_versions: TrafficHub, tiny_embedder_v2_dir: Path
) -> None:
    t = two_versions
    await register(t.client, "other", tiny_embedder_v2_dir)
    r = await t.put({"splits": [{"version": 1, "weight": 0},
                                {"model": "other", "version": 1, "weight": 100}]})  # fmt: skip
    assert r.status_code == 200, r.text
    r = await embed(t.client, "emb", key="anyone")
    assert r.status_code == 200 and r.headers["X-Hub-Model-Version"] == "other@1"
    pinned = await embed(t.client, "other@1")
    assert pinned.json()["data"][0]["embedding"] == r.json()["data"][0]["embedding"]
    assert versions(await t.readout())["other@1"]["routed"] == 1


async def test_ten_thousand_routed_requests_pass_the_sample_ratio_check(
    two_versions: TrafficHub,
) -> None:
    """10,000 requests through the router and serve()'s recording hooks (the model call is
    left out: routing and bookkeeping are under test, not the embedder)."""
    t = two_versions
    await t.put({"splits": [{"version": 1, "weight": 90}, {"version": 2, "weight": 10}]})
    hub = t.hub
    for _ in range(10_000):
        route = hub.router.route("emb")  # no key: a random bucket
        hub.traffic.finish(hub.traffic.begin(route), latency_s=0.001, status=200)
    readout = await t.readout()
    srm = readout["sample_ratio"]
    assert srm["status"] == "ok" and srm["p_value"] > 0.001, srm
    rows = versions(readout)
    assert rows["1"]["routed"] + rows["2"]["routed"] == 10_000
    assert 850 <= rows["2"]["routed"] <= 1150

    # A logging bug that loses a quarter of version 2's requests is caught.
    await t.put({"splits": [{"version": 1, "weight": 90}, {"version": 2, "weight": 10}]})
    for i in range(10_000):
        route = hub.router.route("emb")
        served = hub.traffic.begin(route)
        lost = route.version == 2 and i % 4 == 0
        hub.traffic.finish(served, latency_s=0.001, status=None if lost else 200)
    srm = (await t.readout())["sample_ratio"]
    assert srm["status"] == "mismatch" and srm["p_value"] < 0.001, srm


async def test_readout_per_version_with_injected_faults(two_versions: TrafficHub) -> None:
    t = two_versions
    r = await t.put(
        {"splits": [{"version": 1, "weight": 50}, {"version": 2, "weight": 50}],
         "faults": [{"version": 2, "error_percent": 100}]}
    )  # fmt: skip
    assert r.status_code == 200
    codes: dict[str, list[int]] = {"1": [], "2": []}
    for i in range(100):
        r = await embed(t.client, key=f"k{i}")
        codes[r.headers["X-Hub-Model-Version"]].append(r.status_code)
        if r.status_code == 503:
            assert "injected fault" in r.json()["error"]["message"]
    assert set(codes["1"]) == {200} and set(codes["2"]) == {503}
    # A caller's mistake (400) is not the model's error.
    bad = await t.client.post(
        "/v1/embeddings", json={"model": "emb@1", "input": ["w " * 999], "truncate": False}
    )
    assert bad.status_code == 400
    readout = await t.readout()
    rows = versions(readout)
    assert rows["1"]["errors"] == 0 and rows["1"]["requests"] == len(codes["1"]) + 1
    assert rows["2"]["errors"] == rows["2"]["requests"] == len(codes["2"])
    assert rows["1"]["tokens_per_second"] > 0 and rows["1"]["latency_ms"]["p95"] > 0
    assert rows["2"]["latency_ms"]["p50"] is None  # no successful request to time
    assert readout["baseline"] == "1"
    [comparison] = readout["comparisons"]
    assert comparison["version"] == "2" and comparison["error_rate"]["status"] == "significant"
    assert comparison["latency"]["status"] == "insufficient data"
    assert comparison["latency"]["p_value"] is None
    assert readout["sample_ratio"]["status"] in ("ok", "mismatch")
    assert "every replica" in readout["scope"]
    assert readout["replicas"] == [t.hub.traffic.shared.replica]  # one hub, one contributor
    assert await t.hub.traffic.shared.flush()  # written to SQL: the readout stays the same
    assert versions(await t.readout()) == rows
    metrics = (await t.client.get("/metrics")).text
    assert 'hub_traffic_stats_flushes_total{outcome="ok"}' in metrics
    assert 'hub_injected_faults_total{fault="error",model="emb",version="2"}' in metrics
    assert "/readout" in (await t.client.get("/")).text  # the dashboard's traffic panel
