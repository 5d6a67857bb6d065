"""Rate limits per key: 429 in OpenAI's shape with its x-ratelimit-* headers and Retry-After,
as the openai SDK surfaces it (RateLimitError); buckets refill with time, settle on the usage
an answer reports, and bound concurrent requests."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import httpx
import openai
import pytest

from hub.rate_limits.limiter import RateLimited, RateLimiter, metered
from registry.db import Database
from registry.keys import ApiKeys, KeyLimits
from tests.support.hubs import ADMIN, admin_register, auth_settings, running_app


async def test_the_openai_sdk_sees_a_key_over_its_limit_as_rate_limit_error(
    tmp_path: Path, mlflow_template: Path
) -> None:
    """Admission comes before the route: the requests here name no registered model (each
    admitted one is a 404, counted all the same), so no model is loaded."""
    settings, _ = auth_settings(tmp_path / "hub", mlflow_template)
    keys = ApiKeys(Database(settings.database_url))
    limited, _ = keys.create("limited", "user", limits=KeyLimits(requests_per_minute=2))
    tokens, _ = keys.create("tokens", "user", limits=KeyLimits(tokens_per_minute=100))
    request = {"model": "emb", "input": "hi"}
    async with running_app(settings) as (app, client):

        def sdk(key: str) -> openai.AsyncOpenAI:
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://hub")
            return openai.AsyncOpenAI(
                base_url="http://hub/v1", api_key=key, max_retries=0, http_client=http
            )

        for remaining in ("1", "0"):
            headers = {"Authorization": f"Bearer {limited}"}
            r = await client.post("/v1/embeddings", json=request, headers=headers)
            assert r.status_code == 404
            assert r.headers["x-ratelimit-limit-requests"] == "2"
            assert r.headers["x-ratelimit-remaining-requests"] == remaining
        with pytest.raises(openai.RateLimitError) as refused:
            await sdk(limited).embeddings.create(model="emb", input="hi")
        error = refused.value
        assert error.status_code == 429 and error.code == "rate_limit_exceeded"
        assert error.type == "rate_limit_exceeded"
        headers = error.response.headers
        assert int(headers["retry-after"]) >= 1
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert headers["x-ratelimit-reset-requests"].endswith("s")
        # A key with no limits is not touched.
        r = await client.post("/v1/embeddings", json=request, headers=ADMIN)
        assert r.status_code == 404 and "x-ratelimit-limit-requests" not in r.headers

        # A request whose max_tokens cannot fit the token limit is refused up front.
        with pytest.raises(openai.RateLimitError, match="lower max_tokens"):
            await sdk(tokens).completions.create(model="llm", prompt="hi", max_tokens=500)
        r = await client.post(
            "/v1/embeddings", json=request, headers={"Authorization": f"Bearer {tokens}"}
        )
        assert r.headers["x-ratelimit-limit-tokens"] == "100"
        # Its prompt's estimate was taken from the bucket before it was served.
        assert int(r.headers["x-ratelimit-remaining-tokens"]) < 100


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_buckets_refill_with_time_and_bound_concurrency() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    limits = KeyLimits(requests_per_minute=60, max_concurrent=2)
    first = limiter.admit("k", limits, 1, None)
    limiter.admit("k", limits, 1, None)
    with pytest.raises(RateLimited, match="max_concurrent"):
        limiter.admit("k", limits, 1, None)
    limiter.settle(first)
    for _ in range(57):
        limiter.settle(limiter.admit("k", limits, 1, None))
    limiter.admit("k", limits, 1, None)  # the 60th this minute, with one still in flight
    with pytest.raises(RateLimited) as refused:
        limiter.admit("k", KeyLimits(requests_per_minute=60), 1, None)
    assert refused.value.headers["Retry-After"] == "1"
    clock.now = 1.0  # one request's worth refilled
    limiter.admit("k", KeyLimits(requests_per_minute=60), 1, None)
    # Two replicas share max_concurrent: each admits half of it at once.
    limits = KeyLimits(max_concurrent=4)
    halves = [limiter.admit("shared", limits, 2, None) for _ in "ab"]
    with pytest.raises(RateLimited, match="share of max_concurrent 4"):
        limiter.admit("shared", limits, 2, None)
    limiter.settle(halves[0])
    limiter.admit("shared", limits, 2, None)


async def test_a_stream_is_charged_as_its_events_pass() -> None:
    limiter = RateLimiter(Clock())
    limits = KeyLimits(tokens_per_minute=1000)
    body = b'{"model": "m", "prompt": "' + b"x" * 36 + b'", "max_tokens": 200}'
    admission = limiter.admit("k", limits, 1, body)
    assert admission.reserved == 200 + math.ceil(len(body) / 4)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    stream = metered(send, admission)
    await stream({"type": "http.response.start", "status": 200,
                  "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
    events = b"".join(b'data: {"choices":[{"text":"t"}]}\n\n' for _ in range(7))
    await stream({"type": "http.response.body", "body": events + b"data: [DONE]\n\n"})
    assert (b"x-ratelimit-limit-tokens", b"1000") in sent[0]["headers"]
    assert admission.streamed == 7
    limiter.settle(admission)
    remaining = limiter.status("k", limits)["x-ratelimit-remaining-tokens"]
    assert int(remaining) == 1000 - (admission.prompt + 7)

    # Without max_tokens only the prompt is reserved: the tokens past it are charged as
    # they pass, before the stream ends.
    unbounded = limiter.admit("u", limits, 1, b'{"model": "m", "prompt": "hi"}')
    stream = metered(send, unbounded)
    await stream({"type": "http.response.start", "status": 200,
                  "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
    await stream({"type": "http.response.body", "body": events, "more_body": True})
    remaining = limiter.status("u", limits)["x-ratelimit-remaining-tokens"]
    assert int(remaining) == 1000 - (unbounded.prompt + 7)


async def test_a_token_limit_holds_for_streamed_completions(
    tmp_path: Path, mlflow_template: Path, tiny_llm_dir: Path
) -> None:
    """Streamed completions of a key limited in tokens a minute, one after another, until a
    429: what was answered (prompt and completion tokens, from each stream's usage event)
    stays within the limit plus the refill meanwhile and one request's overshoot of its
    estimate; each stream's tokens are charged before the next request is admitted."""
    limit = 400
    settings, _ = auth_settings(tmp_path / "hub", mlflow_template)
    keys = ApiKeys(Database(settings.database_url))
    secret, _ = keys.create("streams", "user", limits=KeyLimits(tokens_per_minute=limit))
    headers = {"Authorization": f"Bearer {secret}"}
    body = {"model": "llm", "prompt": "the cat sat on the mat", "max_tokens": 16, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}  # fmt: skip
    async with running_app(settings) as (_, client):
        await admin_register(client, "llm", "llm", tiny_llm_dir)
        used: list[int] = []
        remaining: list[int] = []
        refused = None
        start = time.monotonic()
        for _ in range(100):
            async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                if r.status_code == 429:
                    refused = r
                    await r.aread()
                    break
                assert r.status_code == 200, await r.aread()
                remaining.append(int(r.headers["x-ratelimit-remaining-tokens"]))
                events = [line async for line in r.aiter_lines() if line.startswith("data: {")]
            usage = json.loads(events[-1][len("data: ") :])["usage"]
            assert usage["completion_tokens"] > 0
            used.append(usage["total_tokens"])
        assert refused is not None, f"{len(used)} streams and no 429 under {limit} tokens"
        elapsed = time.monotonic() - start
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.headers["x-ratelimit-limit-tokens"] == str(limit)
        assert sum(used) <= limit + elapsed * limit / 60 + max(used)
        # Each admission saw the tokens of every stream before it: what remained fell by
        # what the previous stream used, less the refill meanwhile (the buckets replay
        # consumption in slots of a sixtieth of the period: up to one slot's refill more).
        refill = (elapsed + 1) * limit / 60 + 1
        for before, after, spent in zip(remaining, remaining[1:], used, strict=False):
            assert after <= before - spent + refill
