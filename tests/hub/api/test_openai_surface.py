"""The OpenAI surface real clients rely on, through the official openai SDK against a live hub:
`models.retrieve`, 400s the SDK raises as BadRequestError, fields OpenAI clients send that the
hub accepts and ignores, the usage event only when asked for, `text_offset`; and `/health`."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from hub.settings import HubSettings
from tests.hub.api.test_embeddings import register
from tests.support.live import live_hub

MESSAGES = [{"role": "user", "content": "Hello there!"}]


def test_health_answers_while_the_process_is_up(client: TestClient) -> None:
    r = client.get("/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "ready": True}


def test_retrieve_a_model_by_name_version_and_alias(
    client: TestClient, tiny_embedder_dir: Path
) -> None:
    register(client, "emb", "embedder", tiny_embedder_dir, aliases=["production"])
    card = client.get("/v1/models/emb").json()
    assert card == client.get("/v1/models").json()["data"][0]
    assert card["object"] == "model" and card["id"] == "emb" and card["versions"] == [1]
    assert client.get("/v1/models/emb@1").json()["id"] == "emb@1"
    assert client.get("/v1/models/emb@production").json()["id"] == "emb@production"
    for unknown, words in [("ghost", "known models: emb"), ("emb@7", "no version or alias")]:
        r = client.get(f"/v1/models/{unknown}")
        assert r.status_code == 404
        error = r.json()["error"]
        assert words in error["message"] and error["code"] == "model_not_found"


def test_the_openai_sdk_against_a_live_hub(settings: HubSettings, tiny_llm_dir: Path) -> None:
    import openai

    with live_hub(settings) as (base, _app):
        r = httpx.post(
            f"{base}/admin/registry/models",
            json={"name": "tiny", "kind": "llm", "source": str(tiny_llm_dir)},
        )
        assert r.status_code == 201, r.text
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)

        # models.retrieve parses the model object; an unknown one is the SDK's NotFoundError.
        assert client.models.retrieve("tiny").id == "tiny"
        with pytest.raises(openai.NotFoundError, match="known models: tiny"):
            client.models.retrieve("nope")

        # A value out of range is a 400 naming the field: the SDK's BadRequestError.
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=3)
        assert caught.value.param == "temperature"

        # Fields OpenAI clients send that change nothing here are accepted ...
        plain = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=6, temperature=0
        )
        decorated = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
            store=True,
            metadata={"team": "search"},
            service_tier="auto",
            user="user-1",
            safety_identifier="user-1",
            prompt_cache_key="k",
            prediction={"type": "content", "content": "Hello"},
            reasoning_effort="low",
            verbosity="low",
            modalities=["text"],
            stream_options=None,
        )
        assert decorated.choices[0].message.content == plain.choices[0].message.content
        # ... while unknown fields, and ones the hub cannot honour, are refused, named.
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="tiny", messages=MESSAGES, extra_body={"frobnicate": 1}
            )
        assert caught.value.param == "frobnicate"
        with pytest.raises(openai.BadRequestError, match="modalities"):
            client.chat.completions.create(
                model="tiny", messages=MESSAGES, modalities=["text", "audio"]
            )

        # The loop in OpenAI's docs: every chunk has a choice when usage is not asked for.
        stream = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, stream=True
        )
        chunks = list(stream)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
        assert text == plain.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert all(c.usage is None for c in chunks)
        # Asked for, the usage comes last, in a chunk with no choices.
        chunks = list(
            client.chat.completions.create(
                model="tiny",
                messages=MESSAGES,
                max_tokens=6,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
        assert all(c.choices and c.usage is None for c in chunks[:-1])

        # Legacy completions: the same, and each token's text_offset points at it in the text.
        stream = client.completions.create(
            model="tiny", prompt="Once upon", max_tokens=8, temperature=0, stream=True, logprobs=2
        )
        pieces = list(stream)
        assert all(p.choices for p in pieces)
        whole = client.completions.create(
            model="tiny", prompt="Once upon", max_tokens=8, temperature=0, logprobs=2
        )
        choice = whole.choices[0]
        assert choice.logprobs is not None
        tokens, offsets = choice.logprobs.tokens or [], choice.logprobs.text_offset or []
        assert len(offsets) == len(tokens) == whole.usage.completion_tokens
        assert offsets[0] == 0
        assert [choice.text[o : o + len(t)] for o, t in zip(offsets, tokens, strict=True)] == tokens
        streamed = [o for p in pieces if p.choices[0].logprobs
                    for o in p.choices[0].logprobs.text_offset or []]  # fmt: skip
        assert streamed == offsets
        echoed = client.completions.create(
            model="tiny", prompt="Once upon", max_tokens=8, temperature=0, echo=True
        )
        assert echoed.choices[0].text == "Once upon" + choice.text
