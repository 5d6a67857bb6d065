"""Errors coded as OpenAI codes them, so clients that branch on `code` or `type` (SDK retry
logic, LangChain's context-overflow handling) see what they expect: an over-long prompt is
`context_length_exceeded` naming the field the prompt came from, a bad key
`invalid_api_key`, anything missing a 404 `not_found_error`, and a model of the wrong kind
is said in plain English."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from hub.app import create_app
from tests.hub.api.test_embeddings import register
from tests.support.hubs import auth_settings

# A small context, so a prompt of ordinary length overflows it in tokens (not by the
# character bound checked before tokenizing).
CONTEXT = {"max_model_len": 64}
LONG = "word " * 80
# Millions of characters: refused by their length alone, before tokenizing.
HUGE = "word " * 1_000_000


def _error(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error: dict[str, Any] = r.json()["error"]
    return error


def test_an_over_long_prompt_is_context_length_exceeded_naming_its_field(
    client: TestClient, tiny_llm_dir: Path
) -> None:
    register(client, "tiny", "llm", tiny_llm_dir, config=CONTEXT)
    for text in (LONG, HUGE):
        chat = client.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": text}]},
        )
        error = _error(chat, 400)
        assert (error["param"], error["code"]) == ("messages", "context_length_exceeded"), error
        assert error["type"] == "invalid_request_error"
        completion = client.post("/v1/completions", json={"model": "tiny", "prompt": text})
        error = _error(completion, 400)
        assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded"), error
        response = client.post("/v1/responses", json={"model": "tiny", "input": text})
        error = _error(response, 400)
        assert (error["param"], error["code"]) == ("input", "context_length_exceeded"), error
    ids = client.post("/models/tiny/generate", json={"prompt_token_ids": [5] * 80})
    error = _error(ids, 400)
    assert (error["param"], error["code"]) == ("prompt_token_ids", "context_length_exceeded")
    # A prompt that fits, with more to generate than the context has left: the same code,
    # naming the field to lower.
    short = {"model": "tiny", "prompt": "word " * 13, "max_tokens": 60}
    error = _error(client.post("/v1/completions", json=short), 400)
    assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded"), error
    # Other bad input about the prompt names the field the request sent, without the code.
    empty = client.post("/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert _error(empty, 400)["code"] != "context_length_exceeded"


def test_a_missing_or_wrong_key_is_invalid_api_key(tmp_path: Path, mlflow_template: Path) -> None:
    settings, user_key = auth_settings(tmp_path / "hub", mlflow_template)
    with TestClient(create_app(settings)) as client:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"X-API-Key": "nope"}):
            error = _error(client.get("/v1/models", headers=headers), 401)
            assert error["code"] == "invalid_api_key", (headers, error)
        ok = client.get("/v1/models", headers={"Authorization": f"Bearer {user_key}"})
        assert ok.status_code == 200


def test_a_model_of_the_wrong_kind_is_named_in_plain_english(
    client: TestClient, tiny_llm_dir: Path, tiny_embedder_dir: Path
) -> None:
    register(client, "tiny-llama", "llm", tiny_llm_dir)
    register(client, "emb", "embedder", tiny_embedder_dir)
    asks = [
        ("/v1/embeddings", {"model": "tiny-llama", "input": "hi"},
         "model 'tiny-llama' is an LLM; embeddings need an embedder"),
        ("/v1/rerank", {"model": "tiny-llama", "query": "q", "documents": ["d"]},
         "model 'tiny-llama' is an LLM; reranking needs a reranker"),
        ("/v1/chat/completions", {"model": "emb", "messages": [{"role": "user", "content": "x"}]},
         "model 'emb' is an embedder; chat completions need an LLM"),
        ("/v1/completions", {"model": "emb", "prompt": "x"},
         "model 'emb' is an embedder; completions need an LLM"),
        ("/models/emb/generate", {"prompt": "x"},
         "model 'emb' is an embedder; generation needs an LLM"),
    ]  # fmt: skip
    for path, body, message in asks:
        error = _error(client.post(path, json=body), 400)
        assert error["message"] == message and error["code"] == "wrong_model_kind", error
        assert error["param"] == "model"


def test_promoting_an_unknown_version_is_not_found_like_an_unknown_model(
    client: TestClient, tiny_embedder_dir: Path
) -> None:
    register(client, "emb", "embedder", tiny_embedder_dir)
    unknown_model = client.post("/v1/embeddings", json={"model": "nope", "input": "hi"})
    assert _error(unknown_model, 404)["type"] == "not_found_error"
    for path in (
        "/admin/registry/models/emb/versions/7/promote",
        "/admin/registry/models/nope/versions/1/promote",
    ):
        error = _error(client.post(path, json={"to": "staging"}), 404)
        assert error["type"] == "not_found_error", error
    versions = client.get("/admin/registry/models/nope/versions")
    assert _error(versions, 404)["type"] == "not_found_error"
