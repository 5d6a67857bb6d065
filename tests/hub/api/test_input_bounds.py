"""Texts too long to fit are settled by their length, before any tokenizing: a prompt longer
than the model's context could hold is a 400 naming the field; an embeddings or rerank input
is cut when truncation is on (the answer equals the whole text's, truncated) and a 400
naming the field when it is off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI

from backends.encoders.tokenization import EncoderTokenizer
from backends.text_bounds import CharBound

# ~5 characters a token: far more tokens than the tiny models' contexts, and (5 MB) more
# characters than their length bound.
HUGE = "word " * 1_000_000


@pytest.fixture
def tokenized(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The character counts of the texts the encoder tokenizers were given."""
    seen: list[int] = []
    encode = EncoderTokenizer.encode

    def spy(self: EncoderTokenizer, inputs: Any) -> Any:
        seen.extend(len(x) if isinstance(x, str) else len(x[0]) + len(x[1]) for x in inputs)
        return encode(self, inputs)

    monkeypatch.setattr(EncoderTokenizer, "encode", spy)
    return seen


async def _register(
    app: FastAPI, client: httpx.AsyncClient, name: str, kind: str, folder: Path
) -> CharBound:
    """Register and load `name`; its encoder tokenizer's length bound (None for an LLM)."""
    r = await client.post(
        "/admin/registry/models", json={"name": name, "kind": kind, "source": str(folder)}
    )
    assert r.status_code == 201, r.text
    async with app.state.hub.manager.acquire(name, 1) as backend:
        bound: CharBound = (
            getattr(backend, "_prompt_bound", None) or backend._stages.tokenizer.char_bound
        )
    return bound


async def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(
    app_client: tuple[FastAPI, httpx.AsyncClient],
    tiny_llm_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app, client = app_client
    bound = await _register(app, client, "tiny", "llm", tiny_llm_dir)
    assert len(HUGE) > bound.max_chars
    async with app.state.hub.manager.acquire("tiny", 1) as backend:
        lengths: list[int] = []
        encode = backend.tokenizer.encode
        monkeypatch.setattr(
            backend.tokenizer, "encode", lambda t, **k: lengths.append(len(t)) or encode(t, **k)
        )
        r = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": HUGE, "max_tokens": 1}
        )
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "prompt" and f"{len(HUGE):,} characters" in error["message"]
        messages = [{"role": "user", "content": HUGE}]
        r = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert lengths == [], "a hopeless prompt was tokenized"


async def test_an_embeddings_input_is_cut_with_truncation_and_refused_without(
    app_client: tuple[FastAPI, httpx.AsyncClient], tiny_embedder_dir: Path, tokenized: list[int]
) -> None:
    app, client = app_client
    bound = await _register(app, client, "emb", "embedder", tiny_embedder_dir)
    # Within the bound (not cut), and still more tokens than the model takes.
    within = HUGE[: bound.max_chars]
    assert bound.max_chars // 5 > bound.max_tokens
    whole = await client.post("/v1/embeddings", json={"model": "emb", "input": within})
    cut = await client.post("/v1/embeddings", json={"model": "emb", "input": HUGE})
    assert whole.status_code == cut.status_code == 200, cut.text
    # Both truncated to the model's maximum: the same tokens, the same vector.
    np.testing.assert_allclose(
        cut.json()["data"][0]["embedding"], whole.json()["data"][0]["embedding"], atol=1e-6
    )
    refused = await client.post(
        "/v1/embeddings", json={"model": "emb", "input": ["ok", HUGE], "truncate": False}
    )
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "input" and "input[1] has" in error["message"]
    assert max(tokenized) <= 2 * bound.max_chars, "a text far over the bound was tokenized"


async def test_a_rerank_document_is_cut_with_truncation_and_refused_without(
    app_client: tuple[FastAPI, httpx.AsyncClient], tiny_reranker_dir: Path, tokenized: list[int]
) -> None:
    app, client = app_client
    bound = await _register(app, client, "rr", "reranker", tiny_reranker_dir)
    body = {"model": "rr", "query": "a word", "documents": [HUGE[: bound.max_chars], HUGE]}
    r = await client.post("/v1/rerank", json=body)
    assert r.status_code == 200, r.text
    scores = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert scores[0] == pytest.approx(scores[1], abs=1e-6)
    r = await client.post("/v1/rerank", json={**body, "truncate": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
    assert max(tokenized) <= 2 * bound.max_chars + 6, "a text far over the bound was tokenized"
