"""LLM architectures as a user meets them over HTTP: Gemma 3, Qwen3-MoE and Mixtral answer many
concurrent requests with transformers' greedy output (chunked prefill, prefix hits and
preemption all forced by the runtime config), and an architecture the engine cannot run is
refused at registration (400 naming the supported ones), leaving nothing registered."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from backends.llm.sequence import Logprob
from tests.backends.llm.support import Completion, build_model, kv_bytes
from tests.backends.llm.test_correctness import (
    BLOCK_SIZE,
    STEP_BUDGET,
    compare,
    hf_reference,
    workload,
)

ARCHS = ("gemma3_text", "qwen3_moe", "mixtral")


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("http-arch-models")


async def generate(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, n: int
) -> list[Completion]:
    body = {
        "prompt_token_ids": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 5,
        "n": n,
    }
    r = await client.post(f"/models/{model}/generate", json=body)
    assert r.status_code == 200, r.text
    return [
        Completion(
            token_ids=c["token_ids"],
            logprobs=[
                Logprob(lp["token_id"], lp["logprob"], tuple((t, v) for t, v in lp["top"]))
                for lp in c["logprobs"]
            ],
        )
        for c in r.json()["choices"]
    ]


@pytest.mark.parametrize("arch", ARCHS)
async def test_concurrent_greedy_output_over_http_equals_transformers(
    arch: str, models_root: Path, app_client: tuple[FastAPI, httpx.AsyncClient]
) -> None:
    _, client = app_client
    folder = build_model(models_root, arch)
    requests = workload()
    refs = hf_reference(folder, [p for p, _ in requests])
    config = {
        "block_size": BLOCK_SIZE,
        "max_num_seqs": 8,
        "max_num_batched_tokens": STEP_BUDGET,
        # A third of what the load needs: sequences are preempted and recomputed.
        "kv_cache_bytes": kv_bytes(folder, 24, BLOCK_SIZE),
    }
    body = {"name": arch, "kind": "llm", "source": str(folder), "config": config}
    r = await client.post("/admin/registry/models", json=body)
    assert r.status_code == 201, r.text

    results = await asyncio.gather(
        *(generate(client, arch, p, params.max_tokens or 0, params.n) for p, params in requests)
    )
    verdicts = [
        compare(ref, c) for ref, samples in zip(refs, results, strict=True) for c in samples
    ]
    failures = [v for v in verdicts if v not in ("exact", "near-tie")]
    assert not failures, failures
    assert verdicts.count("exact") >= len(verdicts) // 2, verdicts

    metrics = (await client.get("/metrics")).text
    assert _metric(metrics, "hub_llm_prefix_cache_hits_total", arch) > 0
    assert _metric(metrics, "hub_llm_preemptions_total", arch) > 0


def _metric(text: str, name: str, model: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'{name}{{model="{model}"'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for {model} not in /metrics")


async def test_unsupported_architecture_is_refused_at_registration(
    tiny_llm_dir: Path, tmp_path: Path, app_client: tuple[FastAPI, httpx.AsyncClient]
) -> None:
    _, client = app_client
    folder = shutil.copytree(tiny_llm_dir, tmp_path / "gpt2ish")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))

    body = {"name": "odd", "kind": "llm", "source": str(folder)}
    r = await client.post("/admin/registry/models", json=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "'gpt2' is not supported" in message
    assert all(a in message for a in ("llama", "gemma3_text", "mixtral", "qwen3_moe"))
    # Nothing was registered: the name is free and unknown to the API.
    assert (await client.get("/admin/registry/models/odd/versions")).status_code == 404
    body = {"name": "odd", "kind": "llm", "source": str(tiny_llm_dir)}
    r = await client.post("/admin/registry/models", json=body)
    assert r.status_code == 201 and r.json()["version"] == 1
