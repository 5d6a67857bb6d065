"""Odd input over HTTP is the caller's 4xx in the error shape, naming the field, and never a
500: out-of-range sampling values, Unicode digits where a version number goes, odd
`logit_bias` keys, lone UTF-16 surrogates in text, durations that mean nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.hub.api.test_embeddings import register


def _post_raw(client: TestClient, path: str, raw: str) -> Any:
    """POST a JSON text as typed: json.dumps cannot write lone surrogates or NaN as-is."""
    return client.post(path, content=raw.encode(), headers={"content-type": "application/json"})


def _refused(r: Any, param: str, statuses: tuple[int, ...] = (400,)) -> None:
    # OpenAI and vLLM answer a request they refuse with 400, validation errors included.
    assert r.status_code in statuses, r.text
    error = r.json()["error"]
    assert param in (error["param"] or "") or param in error["message"], error


@pytest.fixture
def served(client: TestClient, tiny_embedder_dir: Path, tiny_llm_dir: Path) -> TestClient:
    register(client, "emb", "embedder", tiny_embedder_dir)
    register(client, "tiny", "llm", tiny_llm_dir)
    return client


def test_out_of_range_sampling_values_are_refused_and_the_model_serves_on(
    served: TestClient,
) -> None:
    base = {"model": "tiny", "prompt": "hello there", "max_tokens": 3}
    for field, value in [
        ("top_k", 2**63),
        ("top_k", 10**30),
        ("n", 2**63),
        ("seed", 2**64),
        ("priority", 2**63),
        ("min_tokens", 10**6),
        ("max_tokens", 10**30),
    ]:
        r = served.post("/v1/completions", json={**base, field: value})
        _refused(r, field)
    for key in ["9" * 5000, "²", "１２", "-1", "5" * 11]:
        r = served.post("/v1/completions", json={**base, "logit_bias": {key: 1}})
        _refused(r, "logit_bias")
        assert len(r.text) < 2000  # the key is not echoed back whole
    r = served.post("/v1/completions", json={**base, "logit_bias": {"999999999": 1}})
    _refused(r, "logit_bias")  # ASCII digits, but outside the vocabulary
    r = _post_raw(served, "/v1/completions", json.dumps(base)[:-1] + ', "temperature": NaN}')
    _refused(r, "temperature")
    ok = served.post("/v1/completions", json={**base, "top_k": 2**31 - 1, "seed": 2**63 - 1})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"][0]["text"]) > 0


def test_unicode_digits_are_no_version_number(served: TestClient) -> None:
    for ref in ["²", "١", "1" * 5000]:
        r = served.post("/v1/embeddings", json={"model": f"emb@{ref}", "input": "hi"})
        _refused(r, "model", (404,))
    r = served.post("/models/emb/versions/%C2%B2/embed", json={"input": "hi"})
    assert r.status_code == 404, r.text
    assert "error" in r.json()
    for action in ("load", "unload", "pin", "unpin"):
        r = served.post(f"/admin/models/emb/versions/%C2%B2/{action}")
        assert r.status_code == 404, (action, r.text)
    r = served.get("/admin/registry/models/emb/versions")
    assert r.status_code == 200
    # Plain ASCII digits still name the version.
    r = served.post("/v1/embeddings", json={"model": "emb@1", "input": "hi"})
    assert r.status_code == 200 and r.headers["X-Hub-Model-Version"] == "1"


def test_lone_surrogates_in_text_are_a_400_naming_the_body(served: TestClient) -> None:
    # Every inference route parses its body with pydantic's JSON parser, which refuses the
    # escape itself (400 naming the body and the column); the backends check too, for
    # direct callers (tests/backends/test_text_input.py).
    cases = [
        ("/v1/embeddings", '{"model": "emb", "input": "a\\ud800b"}', "body"),
        ("/v1/embeddings", '{"model": "emb", "input": ["ok", "\\udfff"]}', "body"),
        ("/v1/completions", '{"model": "tiny", "prompt": "x\\ud83d", "max_tokens": 2}', "body"),
        (
            "/v1/chat/completions",
            '{"model": "tiny", "max_tokens": 2, '
            '"messages": [{"role": "user", "content": "hi \\udc00"}]}',
            "body",
        ),
        ("/models/tiny/generate", '{"prompt": "\\ud800", "max_tokens": 2}', "body"),
    ]
    for path, raw, param in cases:
        _refused(_post_raw(served, path, raw), param)
    # A proper pair (an emoji written as two escapes) is fine.
    ok = _post_raw(served, "/v1/embeddings", '{"model": "emb", "input": "\\ud83d\\ude00"}')
    assert ok.status_code == 200, ok.text


def test_keep_alive_must_be_a_finite_duration(served: TestClient) -> None:
    for value in ["NaN", "Infinity", "1e999", "{}", "[]", '"soon"', "true"]:
        raw = '{"model": "emb", "input": "hi", "keep_alive": ' + value + "}"
        _refused(_post_raw(served, "/v1/embeddings", raw), "keep_alive")
        raw = '{"model": "tiny", "prompt": "hi", "max_tokens": 2, "keep_alive": ' + value + "}"
        _refused(_post_raw(served, "/v1/completions", raw), "keep_alive")
    # The forms that mean something are kept: unset, forever, seconds, a duration, at once.
    for value in ["null", "-1", "30", '"5m"', "0"]:
        raw = '{"model": "emb", "input": "hi", "keep_alive": ' + value + "}"
        assert _post_raw(served, "/v1/embeddings", raw).status_code == 200, value


def test_a_canary_interval_must_be_a_finite_duration(
    client: TestClient, tiny_embedder_dir: Path
) -> None:
    register(client, "emb", "embedder", tiny_embedder_dir)
    register(client, "emb", "embedder", tiny_embedder_dir)
    for value in ["NaN", "1e999", "{}", "[]", "null"]:
        raw = '{"version": 2, "interval": ' + value + "}"
        _refused(_post_raw(client, "/admin/traffic/emb/canary", raw), "interval")


def test_a_rollback_resolves_the_split_naming_the_version_leaving_production(
    client: TestClient, tiny_embedder_dir: Path, tiny_embedder_v2_dir: Path
) -> None:
    from tests.hub.test_promotion import promote, served_version

    for folder in (tiny_embedder_dir, tiny_embedder_v2_dir, tiny_embedder_dir):
        register(client, "emb", "embedder", folder)
    for version in (1, 2):
        assert promote(client, version, "staging").status_code == 200
        assert promote(client, version, "production").status_code == 200
    r = client.put(
        "/admin/traffic/emb",
        json={"splits": [{"version": 2, "weight": 80}, {"version": 3, "weight": 20}]},
    )
    assert r.status_code == 200, r.text

    r = client.post("/admin/registry/models/emb/rollback", json={"reason": "v2 regressed"})
    assert r.status_code == 200, r.text
    assert (r.json()["from_version"], r.json()["version"]) == (2, 1)
    rollback = client.get("/admin/registry/events", params={"model": "emb"}).json()[0]
    assert rollback["action"] == "rollback"
    assert rollback["reason"].startswith("v2 regressed; traffic split resolved")
    assert "v2's 80% moved to v1 (split v1 80%, v3 20%)" in rollback["reason"]
    splits = client.get("/admin/traffic/emb").json()["splits"]
    assert [(s["version"], s["weight"]) for s in splits] == [(1, 80.0), (3, 20.0)]
    served = set()
    for i in range(40):
        r = client.post(
            "/v1/embeddings",
            json={"model": "emb", "input": "hi"},
            headers={"X-Hub-Route-Key": f"u{i}"},
        )
        assert r.status_code == 200
        served.add(r.headers["X-Hub-Model-Version"])
    assert "2" not in served and served <= {"1", "3"}

    # A promotion that replaces production resolves it too: v1's share goes to v3, which
    # then has it all, so the split is back to the default (everything to production).
    assert promote(client, 3, "staging").status_code == 200
    r = promote(client, 3, "production")
    assert r.status_code == 200, r.text
    splits = client.get("/admin/traffic/emb").json()["splits"]
    assert [(s["version"], s["weight"]) for s in splits] == [(3, 100.0)]
    events = client.get("/admin/registry/events", params={"model": "emb"}).json()
    assert events[0]["action"] == "promote" and events[1]["action"] == "traffic"
    assert "v1's 80% moved to v3 (default split (everything to production))" in events[0]["reason"]
    assert served_version(client) == "3"
