"""Automated canaries: a failing or slow version is rolled back, a healthy one is promoted
through the registry, a restarted hub resumes a canary at its step, bad starts are refused.

The controller is driven by `tick(now)` with a test clock that jumps a whole interval at a
time; the background loop is parked (`canary_tick: 1h`) except in the one test about it."""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path
from typing import Any

import pytest

from hub.traffic.faults import Timer
from tests.support.hubs import make_settings, running_app
from tests.support.traffic_hub import TrafficHub, embed, register

PARKED = {"canary_tick": "1h"}
HOUR = 3600.0


class TestClock:
    """Jumps past the canary's interval on every call (from the real time when that is
    later, as a canary's first step starts at the real time)."""

    __test__ = False

    def __init__(self) -> None:
        self.now = time.time()

    def next_interval(self) -> float:
        self.now = max(self.now, time.time()) + HOUR + 1
        return self.now


async def promote(t: TrafficHub, version: int, to: str) -> None:
    r = await t.client.post(f"/admin/registry/models/emb/versions/{version}/promote",
                            json={"to": to})  # fmt: skip
    assert r.status_code == 200, r.text


async def start(t: TrafficHub, **body: Any) -> dict[str, Any]:
    spec = {"version": 2, "steps": [30, 60, 100], "interval": "1h", "min_requests": 15, **body}
    r = await t.client.post("/admin/traffic/emb/canary", json=spec)
    assert r.status_code == 201, r.text
    doc: dict[str, Any] = r.json()
    return doc


async def canary(t: TrafficHub) -> dict[str, Any]:
    r = await t.client.get("/admin/traffic/emb/canary")
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    return doc


_keys = itertools.count()


async def traffic_until(t: TrafficHub, need: dict[str, int], cap: int = 400) -> None:
    """Send routed requests (distinct keys) until each version in `need` has served that many
    since this call."""
    got = dict.fromkeys(need, 0)
    for _ in range(cap):
        if all(got[v] >= n for v, n in need.items()):
            return
        r = await embed(t.client, key=f"user-{next(_keys)}")
        version = r.headers["X-Hub-Model-Version"]
        got[version] = got.get(version, 0) + 1
    raise AssertionError(f"after {cap} requests the versions served {got}, need {need}")


async def served_versions(t: TrafficHub, n: int = 20) -> set[str]:
    return {(await embed(t.client, key=f"probe-{i}")).headers["X-Hub-Model-Version"]
            for i in range(n)}  # fmt: skip


@pytest.mark.parametrize("traffic_settings", [PARKED])
async def test_a_failing_canary_is_rolled_back(two_versions: TrafficHub) -> None:
    t, clock = two_versions, TestClock()
    await promote(t, 2, "staging")
    r = await t.put({"splits": [{"version": 1, "weight": 100}],
                     "faults": [{"version": 2, "error_percent": 50}]})  # fmt: skip
    assert r.status_code == 200
    started = await start(t)
    assert (started["state"], started["weight"], started["baseline_version"]) == ("running", 30, 1)
    t.hub.traffic.faults.rng = random.Random(7)  # the 50% fault, reproducibly
    controller = t.hub.traffic.canaries
    assert await controller.tick(now=time.time()) == {"emb": "observing"}  # interval not over
    assert await controller.tick(now=clock.next_interval()) == {"emb": "waiting"}  # no traffic
    assert "has 0 of 15 requests" in (await canary(t))["observation"]["reason"]

    await traffic_until(t, {"1": 15, "2": 15})
    assert await controller.tick(now=clock.next_interval()) == {"emb": "rolled_back"}
    status = await canary(t)
    assert status["state"] == "rolled_back"
    assert "error rate" in status["reason"] and "above 5.0%" in status["reason"]
    assert status["last_check"]["canary"]["errors"] > 0
    policy = (await t.client.get("/admin/traffic/emb")).json()
    assert [(s["version"], s["weight"]) for s in policy["splits"]] == [(1, 100.0)]
    assert policy["canary"] is None
    assert await served_versions(t) == {"1"}
    readout = await t.readout()
    assert readout["canary"]["state"] == "rolled_back" and readout["canary"]["reason"]
    models = (await t.client.get("/v1/models")).json()["data"]
    assert models[0]["aliases"]["production"] == 1


class JumpingTimer(Timer):
    """Request latencies on the real clock, but an injected delay moves the clock forward
    instead of waiting: the fault's 250 ms show in the latencies and cost no time."""

    def __init__(self) -> None:
        self.offset = 0.0

    def now(self) -> float:
        return super().now() + self.offset

    async def sleep(self, seconds: float) -> None:
        self.offset += seconds


@pytest.mark.parametrize("traffic_settings", [PARKED])
async def test_a_slow_canary_is_rolled_back_on_latency(two_versions: TrafficHub) -> None:
    t, clock = two_versions, TestClock()
    t.hub.traffic.use_timer(JumpingTimer())
    await promote(t, 2, "staging")
    await t.put({"splits": [{"version": 1, "weight": 100}],
                 "faults": [{"version": 2, "delay_ms": 250}]})  # fmt: skip
    await start(t, steps=[50, 100], min_requests=12)
    await traffic_until(t, {"1": 12, "2": 12})
    assert await t.hub.traffic.canaries.tick(now=clock.next_interval()) == {"emb": "rolled_back"}
    status = await canary(t)
    assert "Mann-Whitney U" in status["reason"] and "limit 1.5x" in status["reason"]
    assert status["last_check"]["latency_ratio_median"] > 1.5
    assert status["last_check"]["replicas"] == [t.hub.traffic.shared.replica]


async def test_a_healthy_canary_survives_a_restart_and_is_promoted(
    tmp_path: Path, mlflow_template: Path, tiny_embedder_dir: Path, tiny_embedder_v2_dir: Path
) -> None:
    # A shared 2-core test machine makes latency noisy: the latency limit is loose here (the
    # latency breach has its own test above).
    settings = make_settings(tmp_path / "hub", mlflow_template, traffic=PARKED)
    clock = TestClock()
    async with running_app(settings) as (app, client):
        t = TrafficHub(app, client)
        await register(client, "emb", tiny_embedder_dir, aliases=["production"])
        await register(client, "emb", tiny_embedder_v2_dir)
        await promote(t, 2, "staging")
        await start(t, max_latency_ratio=10)
        await traffic_until(t, {"1": 15, "2": 15})
        assert await t.hub.traffic.canaries.tick(now=clock.next_interval()) == {"emb": "advanced"}
        status = await canary(t)
        assert (status["step_index"], status["weight"]) == (1, 60)
        assert status["last_check"]["decision"] == "pass"

    async with running_app(settings) as (app, client):  # the hub restarts mid-canary
        t = TrafficHub(app, client)
        status = await canary(t)
        assert (status["state"], status["step_index"], status["weight"]) == ("running", 1, 60)
        policy = (await client.get("/admin/traffic/emb")).json()
        assert [(s["version"], s["weight"]) for s in policy["splits"]] == [(1, 40), (2, 60)]
        controller = t.hub.traffic.canaries
        # The step began as the old process stopped: nobody has served it yet.
        assert await controller.tick(now=clock.next_interval()) == {"emb": "waiting"}
        await traffic_until(t, {"1": 15, "2": 15})
        assert await controller.tick(now=clock.next_interval()) == {"emb": "advanced"}
        assert await served_versions(t) == {"2"}  # 100%
        await traffic_until(t, {"2": 15})
        assert await controller.tick(now=clock.next_interval()) == {"emb": "promoted"}

        status = await canary(t)
        assert status["state"] == "promoted" and "v2 is production" in status["reason"]
        models = (await client.get("/v1/models")).json()["data"]
        assert models[0]["aliases"] == {"production": 2, "staging": 2}
        [event] = [e for e in (await client.get("/admin/registry/events")).json()
                   if e["alias"] == "production" and e["version"] == 2]  # fmt: skip
        assert event["action"] == "promote" and event["actor"].startswith("canary:")
        assert event["validation"]["passed"] is True  # through the gate
        policy = (await client.get("/admin/traffic/emb")).json()
        assert policy["default"] is True  # the split is cleared; production serves
        assert await served_versions(t) == {"2"}


@pytest.mark.parametrize("traffic_settings", [{"canary_tick": "20ms"}])
async def test_the_controller_loop_drives_a_canary(two_versions: TrafficHub) -> None:
    t = two_versions
    await promote(t, 2, "staging")
    await start(t, steps=[50, 100], interval="1ms", min_requests=5, max_latency_ratio=50)
    controller = t.hub.traffic.canaries

    async def until(predicate: Any, ticks: int = 200) -> dict[str, Any]:
        # Counted in controller ticks, not seconds.
        seen = controller.ticks
        while not predicate(doc := await canary(t)):
            assert controller.ticks - seen <= ticks, doc
            await embed(t.client, key=f"loop-{next(_keys)}")
        return doc

    await until(lambda d: d["step_index"] == 1)
    done = await until(lambda d: d["state"] != "running")
    assert done["state"] == "promoted", done


@pytest.mark.parametrize("traffic_settings", [PARKED])
async def test_bad_starts_are_refused_and_abort_restores_the_baseline(
    two_versions: TrafficHub, tiny_embedder_dir: Path
) -> None:
    t = two_versions
    url = "/admin/traffic/emb/canary"
    r = await t.client.post(url, json={"version": 2})
    assert r.status_code == 409 and "has not passed staging" in r.json()["error"]["message"]
    r = await t.client.post(url, json={"version": 9})
    assert r.status_code == 400 and "no version 9" in r.json()["error"]["message"]
    r = await t.client.post(url, json={"version": 1})
    assert r.status_code == 409 and "already production" in r.json()["error"]["message"]
    await register(t.client, "solo", tiny_embedder_dir)
    r = await t.client.post("/admin/traffic/solo/canary", json={"version": 1})
    assert r.status_code == 409 and "no production version" in r.json()["error"]["message"]
    await promote(t, 2, "staging")
    r = await t.client.post(url, json={"version": 2, "steps": [50, 20]})
    assert r.status_code == 400 and "steps: must increase" in r.json()["error"]["message"]
    assert (await t.client.get(url)).status_code == 404  # none was started

    await start(t)
    r = await t.client.post(url, json={"version": 2})
    assert r.status_code == 409 and "already running" in r.json()["error"]["message"]
    r = await t.put({"splits": [{"version": 2, "weight": 100}]})
    assert r.status_code == 409 and "owns the split" in r.json()["error"]["message"]
    assert (await t.client.delete("/admin/traffic/emb")).status_code == 409

    r = await t.client.post(f"{url}/abort", json={"reason": "wrong build"})
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "aborted" and "wrong build" in r.json()["reason"]
    assert await served_versions(t) == {"1"}
    assert (await t.client.post(f"{url}/abort")).status_code == 409
