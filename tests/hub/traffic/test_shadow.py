"""Shadow traffic: the client sees only the primary's bytes; mirrors are compared and
recorded; a full queue or a busy primary drops mirrors instead of delaying anything."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from backends.base import Backend
from hub.traffic.shadow import MirrorJob, exact_match, mean_cosine, rank_correlation
from registry.views import ShadowView
from tests.support.traffic_hub import TrafficHub, register

TEXTS = [f"sentence number {i} about shadow traffic" for i in range(12)]


async def answers(t: TrafficHub) -> list[tuple[bytes, str]]:
    out = []
    for text in TEXTS:
        r = await t.client.post("/v1/embeddings", json={"model": "emb", "input": [text, "b"]})
        assert r.status_code == 200, r.text
        out.append((r.content, r.headers["X-Hub-Model-Version"]))
    return out


def shadow_row(readout: dict[str, Any], label: str) -> dict[str, Any]:
    [row] = [v for v in readout["shadow"]["versions"] if v["version"] == label]
    return row


async def test_shadowing_leaves_primary_responses_byte_identical(
    two_versions: TrafficHub, tiny_embedder_dir: Path
) -> None:
    t = two_versions
    assert await register(t.client, "emb", tiny_embedder_dir) == 3  # v1's weights again
    plain = await answers(t)
    # Every HTTP request was counted in flight until answered, and the gaps between them seen.
    assert t.hub.traffic.in_flight.count == 0 and t.hub.traffic.in_flight.typical_gap() is not None
    split = [{"version": 1, "weight": 100}]
    r = await t.put({"splits": split, "shadow": {"version": 3, "percent": 100}})
    assert r.status_code == 200, r.text
    assert await answers(t) == plain
    await t.hub.traffic.shadow.drain()
    same = shadow_row(await t.readout(), "3")
    assert same["outcomes"] == {"ok": len(TEXTS)} and same["errors"] == 0
    assert same["similarity"]["compared"] == len(TEXTS) and same["similarity"]["min"] > 0.9999
    assert same["latency_ms"]["p50"] > 0 and same["primary_latency_ms"]["p50"] > 0

    await t.put({"splits": split, "shadow": {"version": 2, "percent": 100}})
    assert await answers(t) == plain
    await t.hub.traffic.shadow.drain()
    readout = await t.readout()
    other = shadow_row(readout, "2")
    assert other["mirrored"] == len(TEXTS) and other["similarity"]["mean"] < 0.9
    assert readout["shadow"]["target"] == {"version": "2", "percent": 100.0}
    assert {v["version"] for v in readout["versions"]} == {"1"}  # shadows are not traffic
    metrics = (await t.client.get("/metrics")).text
    assert 'hub_shadow_requests_total{model="emb",outcome="ok",version="2"}' in metrics


@pytest.mark.parametrize("traffic_settings", [{"shadow_queue_size": 2}])
async def test_a_full_queue_drops_mirrors(two_versions: TrafficHub) -> None:
    t = two_versions
    await t.hub.traffic.shadow.stop()  # no worker: nothing leaves the queue
    r = await t.put({"splits": [{"version": 1, "weight": 100}],
                     "shadow": {"version": 2, "percent": 100}})  # fmt: skip
    assert r.status_code == 200
    for text in TEXTS[:5]:
        r = await t.client.post("/v1/embeddings", json={"model": "emb", "input": [text]})
        assert r.status_code == 200
    assert t.hub.traffic.shadow.queued == 2
    assert shadow_row(await t.readout(), "2")["outcomes"] == {"dropped_full": 3}


class CountingReplay:
    """Records that it ran; the queue's behaviour is under test, not a comparison."""

    def __init__(self) -> None:
        self.runs = 0

    async def run(self, backend: Backend) -> str:
        self.runs += 1
        return backend.kind.value

    def compare(self, primary: Any, shadow: Any) -> float:
        return 1.0 if primary == shadow else 0.0


@pytest.mark.parametrize("traffic_settings", [{"shadow_max_wait": "200ms"}])
async def test_a_mirror_waits_for_an_idle_primary_and_gives_up(two_versions: TrafficHub) -> None:
    t = two_versions
    mirror, in_flight = t.hub.traffic.shadow, t.hub.traffic.in_flight
    replay = CountingReplay()

    def job() -> MirrorJob:
        return MirrorJob(model="emb", shadow=ShadowView("emb", 2, 100), kind="embedder",
                         replay=replay, output="embedder", primary_latency_s=0.01)  # fmt: skip

    in_flight.enter()  # a primary request is being served
    await mirror.run(job())
    assert replay.runs == 0 and mirror.outcomes[("emb", "2", "dropped_stale")] == 1
    in_flight.leave()
    await mirror.run(job())
    assert replay.runs == 1 and mirror.outcomes[("emb", "2", "ok")] == 1


class SlowReplay(CountingReplay):
    async def run(self, backend: Backend) -> str:
        self.runs += 1
        await asyncio.sleep(0.2)
        return backend.kind.value


@pytest.mark.parametrize("traffic_settings", [{"shadow_max_wait": "1s"}])
async def test_a_saturated_primary_is_not_shadowed(two_versions: TrafficHub) -> None:
    """Requests coming closer together than a replay lasts: a replay would overlap the next
    one, so the mirror waits for a long enough quiet moment, and is dropped without one."""
    t = two_versions
    mirror, in_flight = t.hub.traffic.shadow, t.hub.traffic.in_flight
    replay = SlowReplay()

    def job() -> MirrorJob:
        return MirrorJob(model="emb", shadow=ShadowView("emb", 2, 100), kind="embedder",
                         replay=replay, output="embedder", primary_latency_s=0.01)  # fmt: skip

    await mirror.run(job())  # nothing known yet: it runs, and its length becomes known
    assert replay.runs == 1
    stop = asyncio.Event()

    async def back_to_back() -> None:
        while not stop.is_set():
            in_flight.enter()
            await asyncio.sleep(0.005)
            in_flight.leave()
            await asyncio.sleep(0)

    for _ in range(in_flight.GAPS_NEEDED + 1):  # requests back to back: tiny idle gaps
        in_flight.enter()
        in_flight.leave()
    primaries = asyncio.create_task(back_to_back())
    await mirror.run(job())
    stop.set()
    await primaries
    assert replay.runs == 1 and mirror.outcomes[("emb", "2", "dropped_stale")] == 1
    await mirror.run(job())  # the load has eased: quiet for a replay's length, it runs
    assert replay.runs == 2


def test_comparators() -> None:
    a = np.array([[1.0, 0.0], [0.0, 2.0]])
    assert mean_cosine(a, a * 3) == pytest.approx(1.0)
    assert mean_cosine(a, -a) == pytest.approx(-1.0)
    assert mean_cosine(a, np.ones((2, 3))) is None  # another dimension: not comparable
    assert rank_correlation([0.1, 0.5, 0.9], [1.0, 2.0, 3.0]) == pytest.approx(1.0)
    assert rank_correlation([0.1, 0.5, 0.9], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert rank_correlation([0.3], [0.3]) is None
    assert (exact_match("the cat", "the cat"), exact_match("the cat", "a cat")) == (1.0, 0.0)
