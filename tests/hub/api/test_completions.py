"""Text generation over HTTP: OpenAI completions and chat (plain and streamed, through the
official client), the per-model generate routes, and bad input that never reaches the engine."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from fastapi.testclient import TestClient

from hub.settings import HubSettings
from tests.hub.api.test_embeddings import register
from tests.support.live import live_hub

PROMPT = "The harbour town woke slowly on winter mornings"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]


def hf_greedy(folder: Path, ids: list[int], max_new_tokens: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return str(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))


def tokenizer_of(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_completion_equals_transformers_greedy(client: TestClient, tiny_llm_dir: Path) -> None:
    register(client, "tiny", "llm", tiny_llm_dir, config={"block_size": 4})
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["X-Hub-Model-Version"] == "1"
    result = r.json()
    ids = tokenizer_of(tiny_llm_dir).encode(PROMPT)
    assert result["object"] == "text_completion" and result["model"] == "tiny"
    assert result["choices"][0]["text"] == hf_greedy(tiny_llm_dir, ids, 12)
    usage = result["usage"]
    assert usage["prompt_tokens"] == len(ids)
    assert usage["total_tokens"] == len(ids) + usage["completion_tokens"]

    # The same prompt again hits the prefix cache; the engine's series say so.
    assert client.post("/v1/completions", json=body).json()["choices"] == result["choices"]
    text = client.get("/metrics").text
    labels = '{model="tiny",version="1"}'
    assert f"hub_llm_time_to_first_token_seconds_count{labels} 2.0" in text
    assert f"hub_llm_e2e_request_latency_seconds_count{labels} 2.0" in text
    assert f"hub_llm_queue_time_seconds_count{labels} 2.0" in text
    assert metric(text, "hub_llm_prompt_tokens_total") == 2 * len(ids)
    assert metric(text, "hub_llm_generation_tokens_total") == 2 * usage["completion_tokens"]
    assert metric(text, "hub_llm_prefix_cache_hits_total") > 0
    assert metric(text, "hub_llm_prefix_cache_queries_total") == 2 * len(ids)
    assert metric(text, "hub_llm_running_sequences") == 0


def test_chat_completion_answers_from_the_chat_template(
    client: TestClient, tiny_llm_dir: Path
) -> None:
    register(client, "tiny", "llm", tiny_llm_dir)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 10, "temperature": 0, "n": 2}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    tokenizer = tokenizer_of(tiny_llm_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    expected = hf_greedy(tiny_llm_dir, ids, 10)
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(c["message"] == {"role": "assistant", "content": expected} for c in choices)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    # A request too long to be tokenized on the event loop goes to the tokenizer thread:
    # its prompt is the template's all the same.
    long = [{"role": "user", "content": " ".join([PROMPT] * 30)}]
    r = client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": long, "max_tokens": 1}
    )
    assert r.status_code == 200, r.text
    prompt = tokenizer.apply_chat_template(long, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_chat_needs_a_chat_template(client: TestClient, tmp_path: Path, tiny_llm_dir: Path) -> None:
    plain = shutil.copytree(tiny_llm_dir, tmp_path / "plain")
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    register(client, "plain", "llm", plain)
    r = client.post("/v1/chat/completions", json={"model": "plain", "messages": MESSAGES})
    assert r.status_code == 400
    error = r.json()["error"]
    assert "chat template" in error["message"] and error["param"] == "messages"
    assert (
        client.post("/v1/completions", json={"model": "plain", "prompt": "hi"}).status_code == 200
    )


def test_generate_routes_return_tokens_logprobs_and_the_version(
    client: TestClient, tiny_llm_dir: Path
) -> None:
    register(client, "tiny", "llm", tiny_llm_dir)
    register(client, "tiny", "llm", tiny_llm_dir)
    ids = tokenizer_of(tiny_llm_dir).encode(PROMPT)
    body = {
        "prompt_token_ids": ids,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 2,
        "n": 2,
        "ignore_eos": True,
    }
    r = client.post("/models/tiny/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["X-Hub-Model-Version"] == "2"
    result = r.json()
    assert result["version"] == 2 and len(result["choices"]) == 2
    first = result["choices"][0]
    assert len(first["token_ids"]) == 6 and first["finish_reason"] == "length"
    assert all(len(lp["top"]) == 2 and lp["logprob"] <= 0 for lp in first["logprobs"])
    assert first["logprobs"][0]["token_id"] == first["token_ids"][0]
    r = client.post("/models/tiny/versions/1/generate", json={"prompt": PROMPT, "max_tokens": 3})
    assert r.status_code == 200 and r.headers["X-Hub-Model-Version"] == "1"
    r = client.post("/models/tiny/generate", json={"prompt": "a", "messages": MESSAGES})
    assert r.status_code == 400 and "exactly one" in r.json()["error"]["message"]


LIMITS = {"max_model_len": 64, "max_n": 2, "max_tokens_limit": 32, "max_logprobs": 5}


BAD_INPUT: list[tuple[dict[str, Any], int, str, list[str]]] = [
    ({"prompt": "word " * 13, "max_tokens": 30}, 400, "max_tokens", ["64"]),
    ({"prompt": ""}, 400, "prompt", ["empty"]),
    ({"prompt": []}, 400, "prompt", ["empty"]),
    ({"prompt": "hi", "temperature": 3}, 400, "temperature", []),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p", []),
    ({"prompt": "hi", "presence_penalty": -9}, 400, "presence_penalty", []),
    ({"prompt": "hi", "n": 3}, 400, "n", ["limit of 2"]),
    ({"prompt": "hi", "max_tokens": 40}, 400, "max_tokens", ["limit of 32"]),
    ({"prompt": "hi", "logprobs": 9}, 400, "logprobs", ["limit of 5"]),
    ({"prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias", ["vocabulary"]),
]


def test_bad_input_is_refused_naming_the_field_without_touching_the_engine(
    client: TestClient, tiny_llm_dir: Path
) -> None:
    register(client, "tiny", "llm", tiny_llm_dir, config=LIMITS)
    for body, status, param, words in BAD_INPUT:
        r = client.post("/v1/completions", json={"model": "tiny", **body})
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param or param in error["message"], (body, error)
        assert all(w in error["message"] for w in words), (body, error["message"])
    # The context overflow names both numbers: the context and what the request needs.
    prompt_len = len(tokenizer_of(tiny_llm_dir).encode("word " * 13))
    r = client.post("/v1/completions", json={"model": "tiny", **BAD_INPUT[0][0]})
    assert str(prompt_len + 30) in r.json()["error"]["message"]
    text = client.get("/metrics").text
    assert metric(text, "hub_llm_prompt_tokens_total") == 0, "a refused request was queued"
    assert metric(text, "hub_llm_kv_cache_usage_ratio") == 0
    assert client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"}).status_code == 200


def test_a_non_llm_is_refused(client: TestClient, tiny_embedder_dir: Path) -> None:
    register(client, "emb", "embedder", tiny_embedder_dir)
    r = client.post("/v1/completions", json={"model": "emb", "prompt": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_model_kind"


def test_streaming_with_the_openai_client_and_a_disconnect_frees_the_blocks(
    settings: HubSettings, tiny_llm_dir: Path
) -> None:
    import openai

    with live_hub(settings) as (base, _app):
        r = httpx.post(
            f"{base}/admin/registry/models",
            json={"name": "tiny", "kind": "llm", "source": str(tiny_llm_dir)},
        )
        assert r.status_code == 201, r.text
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")

        whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
        chunks = list(
            client.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

        chat = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=8, temperature=0
        )
        deltas = list(
            client.chat.completions.create(
                model="tiny",
                messages=MESSAGES,
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert deltas[0].choices[0].delta.role == "assistant"
        streamed = "".join(d.choices[0].delta.content or "" for d in deltas if d.choices)
        assert streamed == chat.choices[0].message.content
        assert deltas[-1].usage is not None and deltas[-1].choices == []

        # Characters of several bytes arrive one byte token at a time (the tiny tokenizer
        # has no merges for them): no delta shows half a character as U+FFFD.
        wide = "日本語héllo🙂"
        forced = {"model": "tiny", "messages": MESSAGES, "max_tokens": 40, "temperature": 0,
                  "extra_body": {"guided_regex": wide}}  # fmt: skip
        deltas = list(client.chat.completions.create(**forced, stream=True, logprobs=True))
        pieces = [d.choices[0].delta.content or "" for d in deltas if d.choices]
        whole_wide = client.chat.completions.create(**forced).choices[0].message.content
        assert "".join(pieces) == whole_wide
        assert "".join(pieces) == wide and not any("\ufffd" in p for p in pieces)
        # Each token's logprob carries its own bytes, which join back into the characters.
        tokens = [t for d in deltas if d.choices and d.choices[0].logprobs
                  for t in d.choices[0].logprobs.content or []]  # fmt: skip
        assert bytes(b for t in tokens for b in t.bytes).decode() == wide

        body = {
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": 1500,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
            assert response.headers["X-Hub-Model-Version"] == "1"
            lines = response.iter_lines()
            received = [line for line, _ in zip(lines, range(6), strict=False) if line]
        assert len(received) >= 3  # some tokens came, then the client hung up

        deadline = time.monotonic() + 15
        while True:
            text = httpx.get(f"{base}/metrics").text
            idle = (
                metric(text, "hub_llm_kv_cache_usage_ratio") == 0
                and metric(text, "hub_llm_running_sequences") == 0
            )
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert idle, "the disconnected request still holds KV blocks"
        [status] = httpx.get(f"{base}/admin/models").json()
        assert status["in_flight"] == 0, "the stream never released the model"
        assert metric(text, "hub_llm_generation_tokens_total") < 1000, "it was not aborted"
        # Counted as a client that closed the request (nginx's 499), not as a success.
        requests = [line for line in text.splitlines() if line.startswith("hub_requests_total{")]
        gone = [line for line in requests if 'status="499"' in line]
        assert len(gone) == 1 and gone[0].endswith(" 1.0"), requests
