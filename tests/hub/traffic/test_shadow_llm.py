"""Greedy LLM requests mirrored to a shadow version are compared by exact match; sampled
ones are not mirrored (two samples differ even on one model)."""

from __future__ import annotations

from pathlib import Path

from backends.tiny import build_tiny_llm
from tests.hub.traffic.test_shadow import shadow_row
from tests.support.hubs import make_settings, running_app
from tests.support.traffic_hub import TrafficHub, register

PROMPTS = ["The harbour", "A long road", "Seven small boats"]


async def complete(t: TrafficHub, prompt: str, temperature: float = 0.0) -> tuple[bytes, str]:
    body = {"model": "chat", "prompt": prompt, "max_tokens": 6, "temperature": temperature}
    r = await t.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"].encode(), r.headers["X-Hub-Model-Version"]


async def test_greedy_llm_output_is_compared_by_exact_match(
    tmp_path: Path, mlflow_template: Path, tiny_llm_dir: Path, tiny_root: Path
) -> None:
    other = build_tiny_llm(tiny_root / "llm-llama-seed3", "llama", seed=3)
    settings = make_settings(tmp_path / "hub", mlflow_template)
    config = {"kv_cache_bytes": "4MiB"}
    async with running_app(settings) as (app, client):
        t = TrafficHub(app, client)
        await register(client, "chat", tiny_llm_dir, kind="llm", aliases=["production"],
                       config=config)  # fmt: skip
        await register(client, "chat", tiny_llm_dir, kind="llm", config=config)  # same weights
        await register(client, "chat", other, kind="llm", config=config)
        split = [{"version": 1, "weight": 100}]
        plain = [await complete(t, p) for p in PROMPTS]

        assert (await t.put({"splits": split, "shadow": {"version": 2, "percent": 100}},
                            model="chat")).status_code == 200  # fmt: skip
        assert [await complete(t, p) for p in PROMPTS] == plain
        await t.hub.traffic.shadow.drain()
        same = shadow_row(await t.readout("chat"), "2")
        assert same["similarity"]["compared"] == len(PROMPTS) and same["similarity"]["min"] == 1

        await t.put({"splits": split, "shadow": {"version": 3, "percent": 100}}, model="chat")
        assert [await complete(t, p) for p in PROMPTS] == plain
        await complete(t, "sampled, so never mirrored", temperature=1.0)
        await t.hub.traffic.shadow.drain()
        differs = shadow_row(await t.readout("chat"), "3")
        assert differs["similarity"]["compared"] == len(PROMPTS)
        assert differs["similarity"]["mean"] < 1  # another model's greedy text differs
        readout = await t.readout("chat")
        [primary] = readout["versions"]
        assert primary["tokens_per_second"] > 0  # generated tokens reach the readout
