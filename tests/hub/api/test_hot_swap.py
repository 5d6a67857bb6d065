"""Issue 5's story end to end over real HTTP: v1 and v2 of a tiny LLM and of an embedder;
v1 promoted to production and served; v2 promoted through staging with the gate while a
stream started on v1 keeps streaming from v1 to its end; rollback; the audit log tells it."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from backends.tiny import build_tiny_llm
from hub.settings import HubSettings
from tests.support.hubs import make_settings
from tests.support.live import live_hub

LLM_CONFIG = {"kv_cache_bytes": "8MiB", "max_num_seqs": 8}


@pytest.fixture(scope="module")
def llm_v2_dir(tiny_root: Path) -> Path:
    return build_tiny_llm(tiny_root / "llm-llama-v2", "llama", seed=7)


@pytest.fixture
def settings(tmp_path: Path, mlflow_template: Path) -> HubSettings:
    return make_settings(tmp_path / "hub", mlflow_template, devices=[
        {"name": "cpu", "memory_budget": "1GiB"}])  # fmt: skip


def served(http: httpx.Client, model: str) -> str:
    if model.startswith("chat"):
        r = http.post("/v1/completions", json={"model": model, "prompt": "The", "max_tokens": 2})
    else:
        r = http.post("/v1/embeddings", json={"model": model, "input": "x"})
    assert r.status_code == 200, r.text
    return r.headers["X-Hub-Model-Version"]


def test_promotion_story_with_a_stream_across_the_swap(
    settings: HubSettings,
    tiny_llm_dir: Path,
    llm_v2_dir: Path,
    tiny_embedder_dir: Path,
    tiny_embedder_v2_dir: Path,
) -> None:
    with live_hub(settings) as (base, _), httpx.Client(base_url=base, timeout=120) as http:
        for name, kind, folders, config in (
            ("chat", "llm", (tiny_llm_dir, llm_v2_dir), LLM_CONFIG),
            ("emb", "embedder", (tiny_embedder_dir, tiny_embedder_v2_dir), {}),
        ):
            for folder in folders:
                body = {"name": name, "kind": kind, "source": str(folder), "config": config}
                r = http.post("/admin/registry/models", json=body)
                assert r.status_code == 201, r.text

        def promote(name: str, version: int, to: str) -> dict:
            r = http.post(f"/admin/registry/models/{name}/versions/{version}/promote",
                          json={"to": to, "reason": f"{name} v{version} to {to}"})  # fmt: skip
            assert r.status_code == 200, r.text
            return r.json()

        for name in ("chat", "emb"):
            promote(name, 1, "staging")
            promote(name, 1, "production")
            assert served(http, name) == "1"
        checks = {c["name"] for c in promote("chat", 2, "staging")["validation"]["checks"]}
        assert {"load", "generates", "finite"} <= checks

        # A long stream starts on v1 ...
        stream_version: list[str] = []
        chunks: list[str] = []
        first_chunk = threading.Event()

        def stream() -> None:
            body = {"model": "chat", "prompt": "Once", "max_tokens": 200, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
                stream_version.append(r.headers["X-Hub-Model-Version"])
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(line)
                        first_chunk.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(60)
        # ... production moves to v2 while it runs; new requests go to v2 at once.
        assert promote("chat", 2, "production")["from_version"] == 1
        assert served(http, "chat") == "2"
        reader.join(120)
        assert stream_version == ["1"]
        usage = json.loads(chunks[-1].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == 200  # the v1 stream ran to its end

        promote("emb", 2, "staging")
        promote("emb", 2, "production")
        assert served(http, "emb") == "2"
        for name in ("chat", "emb"):
            r = http.post(f"/admin/registry/models/{name}/rollback", json={"reason": "regressed"})
            assert r.status_code == 200, r.text
            assert served(http, name) == "1"

        events = http.get("/admin/registry/events", params={"model": "chat"}).json()
        assert [(e["alias"], e["action"], e["from_version"], e["version"])
                for e in reversed(events)] == [
            ("staging", "promote", None, 1),
            ("production", "promote", None, 1),
            ("staging", "promote", 1, 2),
            ("production", "promote", 1, 2),
            ("production", "rollback", 2, 1),
        ]  # fmt: skip
        assert events[0]["reason"] == "regressed"
