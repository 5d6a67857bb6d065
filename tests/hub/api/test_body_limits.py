"""Bounded bodies: a body over `max_request_body_bytes` is a 413 in the error shape, before it
is read when its length is declared, as soon as the limit is passed when it is chunked; a
huge prompt is tokenized off the event loop, so liveness answers meanwhile."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from backends.llm.backend import LLMBackend
from backends.text_bounds import CharBound
from hub.app import create_app
from tests.hub.api.test_embeddings import register
from tests.support.hubs import make_settings

LIMIT = 2**20


@pytest.fixture
def limited(tmp_path: Path, mlflow_template: Path) -> Iterator[TestClient]:
    settings = make_settings(tmp_path / "hub", mlflow_template, max_request_body_bytes="1MiB")
    assert settings.max_request_body_bytes == LIMIT
    with TestClient(create_app(settings)) as client:
        yield client


def _too_large(r: httpx.Response) -> None:
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert "max_request_body_bytes" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_an_oversized_body_is_413_before_it_is_read(
    limited: TestClient, tiny_embedder_dir: Path
) -> None:
    register(limited, "emb", "embedder", tiny_embedder_dir)
    reads: list[int] = []

    def declared() -> Iterator[bytes]:
        # The body is announced with a length, then would be sent in chunks: none is read.
        for _ in range(32):
            reads.append(1)
            yield b"x" * 65536

    r = limited.post(
        "/v1/embeddings",
        content=declared(),
        headers={"content-type": "application/json", "content-length": str(2 * LIMIT)},
    )
    _too_large(r)
    assert r.json()["error"]["code"] == "request_too_large"
    assert "2.0 MiB" in r.json()["error"]["message"]
    assert len(reads) <= 1  # at most what the client pushed before it got the answer

    body = json.dumps({"model": "emb", "input": ["word " * 1000] * 300}).encode()
    assert len(body) > LIMIT
    _too_large(limited.post("/v1/embeddings", content=body))
    _too_large(limited.post("/v1/completions", content=body))
    _too_large(limited.post("/admin/registry/models", content=body))
    r = limited.post("/v1/embeddings", json={"model": "emb", "input": "small"})
    assert r.status_code == 200


def test_a_chunked_body_is_cut_off_at_the_limit(
    limited: TestClient, tiny_embedder_dir: Path
) -> None:
    register(limited, "emb", "embedder", tiny_embedder_dir)
    sent: list[int] = []

    def chunks(total: int) -> Iterator[bytes]:
        yield b'{"model": "emb", "input": "'
        for _ in range(total // 65536):
            sent.append(65536)
            yield b"a" * 65536
        yield b'"}'

    for path in ("/v1/embeddings", "/admin/traffic/emb/canary"):
        sent.clear()
        r = limited.post(
            path, content=chunks(4 * LIMIT), headers={"content-type": "application/json"}
        )
        _too_large(r)
    # Under the limit, a chunked body is served as usual.
    r = limited.post(
        "/v1/embeddings", content=chunks(LIMIT // 2), headers={"content-type": "application/json"}
    )
    assert r.status_code == 200, r.text
    r = limited.post(
        "/v1/embeddings",
        content=b"{}",
        headers={"content-type": "application/json", "content-length": "2\u0663".encode()},
    )
    assert r.status_code == 400


async def test_liveness_answers_while_a_huge_prompt_is_tokenized(
    app_client: tuple[FastAPI, httpx.AsyncClient],
    tiny_llm_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, client = app_client
    r = await client.post(
        "/admin/registry/models",
        json={"name": "tiny", "kind": "llm", "source": str(tiny_llm_dir)},
    )
    assert r.status_code == 201, r.text
    warm = await client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1}
    )
    assert warm.status_code == 200, warm.text

    started, finished = threading.Event(), threading.Event()
    original = LLMBackend.encode

    def encode(self: LLMBackend, text: str, **kwargs: Any) -> list[int]:
        big = len(text) > 100_000
        if big:
            started.set()
        try:
            return original(self, text, **kwargs)
        finally:
            if big:
                finished.set()

    monkeypatch.setattr(LLMBackend, "encode", encode)
    # As for a model whose context could hold the prompt: the length bound checked before
    # tokenizing (tests/hub/api/test_input_bounds.py) lets it through, so it is tokenized.
    monkeypatch.setattr(CharBound, "fits", lambda self, text: True)
    prompt = ("The harbour town woke slowly on winter mornings. " * 25_000)[: 2**20]
    big = asyncio.create_task(
        client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
    )
    # Were the prompt tokenized on the event loop, this loop would only resume once it was.
    while not started.is_set():  # noqa: ASYNC110 - set from the tokenizer thread
        await asyncio.sleep(0.01)
    live = await client.get("/health/live")
    assert live.status_code == 200
    assert not finished.is_set(), "liveness answered only once the prompt was tokenized"
    r = await big
    # Far longer than the tiny model's context: refused, after tokenizing, as the caller's 400.
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
