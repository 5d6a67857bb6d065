"""Rate limits of a key on one model (`limits.models`): a request must fit both its key's
limits and its model's; a refusal names the limit it hit, the x-ratelimit-* headers report
the tighter bucket, and a version, an alias or a LoRA adapter counts against its model's
name (an adapter against its base model's too)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import openai
import pytest

from hub.rate_limits.limiter import RateLimited, RateLimiter
from hub.rate_limits.scopes import LEDGER_NAME_CHARS, counted_models, ledger_name
from registry.db import Database
from registry.keys import ApiKeys, KeyLimits, ModelLimits
from registry.views import BaseRef
from tests.support.hubs import auth_settings, running_app
from tests.support.snapshots import model_view, snapshot


async def test_a_key_over_its_limit_on_one_model_still_gets_the_others(
    tmp_path: Path, mlflow_template: Path
) -> None:
    """Admission comes before the route: the models named here are not registered (each
    admitted request is a 404, counted all the same), so nothing is loaded."""
    settings, _ = auth_settings(tmp_path / "hub", mlflow_template)
    keys = ApiKeys(Database(settings.database_url))
    limits = KeyLimits(
        requests_per_minute=600,
        tokens_per_minute=10_000,
        models={"llm": ModelLimits(tokens_per_minute=100)},
    )
    secret, _ = keys.create("team", "user", limits=limits)
    team = {"Authorization": f"Bearer {secret}"}
    # About 70 tokens (the body's length over 4): one fits the model's 100 a minute, not two.
    prompt = "x" * 240
    async with running_app(settings) as (app, client):
        r = await client.post("/v1/completions", json={"model": "llm", "prompt": prompt},
                              headers=team)  # fmt: skip
        assert r.status_code == 404
        # The model's bucket is the tighter: its tokens are the ones reported.
        assert r.headers["x-ratelimit-limit-tokens"] == "100"
        assert int(r.headers["x-ratelimit-remaining-tokens"]) < 40
        assert r.headers["x-ratelimit-limit-requests"] == "600"

        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://hub")
        sdk = openai.AsyncOpenAI(
            base_url="http://hub/v1", api_key=secret, max_retries=0, http_client=http
        )
        with pytest.raises(openai.RateLimitError, match="tokens_per_minute for model llm") as e:
            await sdk.completions.create(model="llm", prompt=prompt)
        refused = e.value.response
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert refused.headers["x-ratelimit-limit-tokens"] == "100"
        assert refused.headers["x-ratelimit-reset-tokens"].endswith("s")
        # A version or an alias of the model counts against the model's name.
        r = await client.post("/v1/completions", json={"model": "llm@production",
                              "prompt": prompt}, headers=team)  # fmt: skip
        assert r.status_code == 429, r.text
        r = await client.post("/models/llm/versions/2/generate", json={"prompt": prompt},
                              headers=team)  # fmt: skip
        assert r.status_code == 429, r.text

        # Another model is held to the key's own limits only.
        r = await client.post("/v1/embeddings", json={"model": "emb", "input": prompt},
                              headers=team)  # fmt: skip
        assert r.status_code == 404, r.text
        assert r.headers["x-ratelimit-limit-tokens"] == "10000"
        assert int(r.headers["x-ratelimit-remaining-tokens"]) > 9000
        await http.aclose()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_both_the_keys_and_the_models_buckets_must_hold() -> None:
    limiter = RateLimiter(Clock())
    limits = KeyLimits(
        requests_per_minute=8, models={"chat": ModelLimits(requests_per_minute=5, max_concurrent=1)}
    )
    chat = ("chat",)
    first = limiter.admit("team", limits, 1, None, chat)
    with pytest.raises(RateLimited, match="share of max_concurrent 1 for model chat"):
        limiter.admit("team", limits, 1, None, chat)
    limiter.settle(first)
    for left in ("3", "2", "1", "0"):
        admission = limiter.admit("team", limits, 1, None, chat)
        assert admission.headers["x-ratelimit-remaining-requests"] == left  # the model's
        limiter.settle(admission)
    with pytest.raises(RateLimited, match="requests_per_minute for model chat"):
        limiter.admit("team", limits, 1, None, chat)
    # The key's own bucket (8) still has 3 for another model; then it refuses all.
    for left in ("2", "1", "0"):
        admission = limiter.admit("team", limits, 1, None, ("emb",))
        assert admission.headers["x-ratelimit-remaining-requests"] == left
        limiter.settle(admission)
    with pytest.raises(RateLimited, match=r"reached: requests_per_minute \(8 requests"):
        limiter.admit("team", limits, 1, None, ("emb",))
    # The per-model consumption is kept under a ledger name of its own, synced as a key's.
    assert {"team", "team/chat"} <= set(limiter.ledger.keys)


def test_a_model_counts_against_its_name_and_an_adapter_against_its_base_too() -> None:
    adapter = model_view("sql-bot", "llm", versions=2, aliases={"production": 1})
    on_base = {
        v: dataclasses.replace(view, base=BaseRef("tiny", 1))
        for v, view in adapter.versions.items()
    }
    registry = snapshot(
        model_view("tiny", "llm", aliases={"production": 1}),
        dataclasses.replace(adapter, versions=on_base),
    )
    assert counted_models("tiny@production", registry) == ("tiny",)
    assert counted_models("sql-bot", registry) == ("sql-bot", "tiny")
    assert counted_models("sql-bot@2", registry) == ("sql-bot", "tiny")
    assert counted_models("unknown@3", registry) == ("unknown",)
    assert counted_models(None, registry) == ()
    # A ledger name too long for its column is a digest, the same on every replica.
    long = ledger_name("k" * 200, "m" * 200)
    assert len(long) <= LEDGER_NAME_CHARS and long == ledger_name("k" * 200, "m" * 200)
    assert long != ledger_name("k" * 200, "m" * 199)
