"""LoRA adapters as registry models over HTTP: registered against a base (an alias resolved
and recorded), served by the base's engine (loaded once however many adapters serve), each
answering with its own output and version header; and every refusal a 400 naming why."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from backends.llm.sampling_params import SamplingParams
from hub.manager import ModelKey
from tests.backends.llm.lora_support import ALL_LINEAR, ATTENTION, build_adapter, edit_config

PROMPT = [5, 17, 42, 9, 33, 71, 2, 64]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from backends.tiny import build_tiny_llm

    root = tmp_path_factory.mktemp("lora-http")
    narrow = build_tiny_llm(root / "narrow-base", "llama", hidden_size=32)
    return {
        "other-base": build_adapter(narrow, root / "other-base", ATTENTION, seed=4),
        "attention": build_adapter(tiny_llm_dir, root / "attention", ATTENTION, seed=1),
        "all": build_adapter(tiny_llm_dir, root / "all", ALL_LINEAR, seed=2),
        "all-v2": build_adapter(tiny_llm_dir, root / "all-v2", ALL_LINEAR, r=8, seed=3),
        "rank-16": build_adapter(tiny_llm_dir, root / "rank-16", ATTENTION, r=16, seed=5),
    }


async def register(client: httpx.AsyncClient, name: str, source: Path, **extra: Any) -> int:
    body = {"name": name, "kind": "llm", "source": str(source), **extra}
    r = await client.post("/admin/registry/models", json=body)
    assert r.status_code == 201, r.text
    return int(r.json()["version"])


async def generate(client: httpx.AsyncClient, path: str) -> tuple[list[int], str]:
    body = {"prompt_token_ids": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"], r.headers["X-Hub-Model-Version"]


async def direct(app: FastAPI, adapter: str | None) -> list[int]:
    """The base's backend, asked directly for `adapter`'s greedy output."""
    entry = app.state.hub.manager.entry(ModelKey("tiny", 1))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    tokens: list[int] = []
    async for out in entry.backend.generate(PROMPT, params, adapter=adapter):
        tokens.extend(out.token_ids)
    return tokens


async def test_adapters_serve_on_one_base_each_with_its_own_output(
    tiny_llm_dir: Path, adapters: dict[str, Path], app_client: tuple[FastAPI, httpx.AsyncClient]
) -> None:
    app, client = app_client
    await register(client, "tiny", tiny_llm_dir, aliases=["production"])
    await register(client, "support-bot", adapters["attention"], base="tiny@production")
    await register(client, "support-bot", adapters["all-v2"], base="tiny@1")
    await register(client, "sql-bot", adapters["all"], base="tiny@1")
    r = await client.get("/admin/registry/models/support-bot/versions")
    assert [v["base"] for v in r.json()] == ["tiny@1", "tiny@1"]  # the alias, resolved
    cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert cards["support-bot"]["parent"] == "tiny@1" and cards["tiny"]["parent"] is None

    paths = {
        "tiny": "/models/tiny/generate",
        "support-bot@2": "/models/support-bot/generate",  # the latest version
        "support-bot@1": "/models/support-bot/versions/1/generate",
        "sql-bot@1": "/models/sql-bot/generate",
    }
    # Concurrently, so the engine's steps mix the base and the three adapters.
    answers = dict(zip(paths, await asyncio.gather(*(generate(client, p) for p in paths.values())),
                       strict=True))  # fmt: skip
    assert {k: v for k, (_, v) in answers.items()} == {
        "tiny": "1", "support-bot@2": "2", "support-bot@1": "1", "sql-bot@1": "1"
    }  # fmt: skip
    for key, (tokens, _) in answers.items():
        assert tokens == await direct(app, None if key == "tiny" else key), key
    assert len({tuple(t) for t, _ in answers.values()}) == 4  # four different outputs

    # The OpenAI surfaces serve an adapter by name too (the base's chat template applies).
    chat = {"model": "support-bot@1", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "temperature": 0}  # fmt: skip
    r = await client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.headers["X-Hub-Model-Version"] == "1", r.text
    body = {"model": "sql-bot", "input": "hi", "max_output_tokens": 4, "temperature": 0}
    r = await client.post("/v1/responses", json=body)
    assert r.status_code == 200 and r.headers["X-Hub-Model-Version"] == "1", r.text

    rows = (await client.get("/admin/models")).json()
    bases = [r for r in rows if r["base"] is None and r["state"] == "loaded"]
    assert [(r["name"], r["version"]) for r in bases] == [("tiny", 1)]  # resident once
    assert bases[0]["adapters"] == ["sql-bot@1", "support-bot@1", "support-bot@2"]
    riders = [r for r in rows if r["base"] == "tiny@1"]
    assert {r["state"] for r in riders} == {"loaded"} and len(riders) == 3
    assert all(r["device"] == "cpu" and r["measured_bytes"] > 0 for r in riders)

    # keep_alive 0: off the device at once, kept in host memory, then restored on demand.
    body = {"prompt_token_ids": PROMPT, "max_tokens": 2, "keep_alive": 0}
    assert (await client.post("/models/sql-bot/generate", json=body)).status_code == 200
    await app.state.hub.manager.entry(ModelKey("sql-bot", 1)).evict_task
    assert (await generate(client, paths["sql-bot@1"]))[0] == answers["sql-bot@1"][0]
    [sql] = [r for r in (await client.get("/admin/models")).json() if r["name"] == "sql-bot"]
    assert sql["cold_load_s"] is not None and sql["warm_load_s"] is not None

    metrics = (await client.get("/metrics")).text
    assert 'hub_adapter_loads_total{base="tiny@1",model="sql-bot",source="warm",version="1"}' \
        in metrics  # fmt: skip
    assert 'hub_adapter_requests_total{base="tiny@1",model="support-bot",version="2"} 1.0' \
        in metrics  # fmt: skip


async def test_registration_refusals_name_the_problem(
    tiny_llm_dir: Path,
    tiny_embedder_dir: Path,
    adapters: dict[str, Path],
    tmp_path: Path,
    app_client: tuple[FastAPI, httpx.AsyncClient],
) -> None:
    _, client = app_client
    await register(client, "tiny", tiny_llm_dir, config={"max_lora_rank": 8})
    await register(client, "emb", tiny_embedder_dir, kind="embedder")
    await register(client, "bot", adapters["attention"], base="tiny@1")

    def variant(name: str, **changes: Any) -> Path:
        folder = tmp_path / name
        shutil.copytree(adapters["attention"], folder)
        if changes:
            edit_config(folder, **changes)
        return folder

    pickled = variant("pickled")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"source": str(adapters["attention"])}, 'register it with "base"'),
        ({"source": str(tiny_llm_dir), "base": "tiny@1"}, "base is only for a LoRA adapter"),
        ({"source": str(adapters["attention"]), "base": "nope@1"}, "'nope' is not registered"),
        ({"source": str(adapters["attention"]), "base": "tiny@7"}, "no version or alias '7'"),
        ({"source": str(adapters["attention"]), "base": "tiny"}, "name@version"),
        ({"source": str(adapters["attention"]), "base": "emb@1"}, "is a embedder"),
        ({"source": str(adapters["attention"]), "base": "bot@1"}, "itself a LoRA adapter"),
        ({"source": str(pickled), "base": "tiny@1"}, "pickle"),
        ({"source": str(variant("dora", use_dora=True)), "base": "tiny@1"}, "use_dora"),
        ({"source": str(adapters["other-base"]), "base": "tiny@1"}, "does not fit base tiny@1"),
        ({"source": str(adapters["rank-16"]), "base": "tiny@1"}, "max_lora_rank 8"),
    ]
    for body, reason in cases:
        r = await client.post("/admin/registry/models", json={"name": "x", "kind": "llm", **body})
        assert r.status_code == 400, (body, r.text)
        assert reason in r.json()["error"]["message"], (body, r.text)
    versions = await client.get("/admin/registry/models/x/versions")
    assert versions.status_code == 404  # nothing was registered
