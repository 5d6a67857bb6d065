"""A request's priority: its key's class, lowered but never raised by the request's
`priority` (a class name or an integer level) or OpenAI's `service_tier`; odd values are the
caller's 400 naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from backends.priority import PriorityClass
from hub.api.priority import resolve_level
from tests.hub.api.test_embeddings import register

INTERACTIVE, STANDARD, BATCH = PriorityClass


@pytest.mark.parametrize(
    ("key", "priority", "tier", "level"),
    [
        (STANDARD, None, None, 0),  # nothing asked: the key's class
        (INTERACTIVE, None, None, -1),
        (INTERACTIVE, "batch", None, 1),  # lowered by name
        (STANDARD, 5, None, 5),  # lowered by a vLLM level
        (STANDARD, None, "flex", 1),  # OpenAI's flex tier is the batch class
        (STANDARD, None, "default", 0),
        (BATCH, "interactive", None, 1),  # asking for more gets the key's class
        (BATCH, -7, "priority", 1),
        (STANDARD, "interactive", "flex", 1),  # both asked: the lower-ranked
    ],
)
def test_a_request_may_lower_its_class_never_raise_it(
    key: PriorityClass, priority: int | str | None, tier: str | None, level: int
) -> None:
    assert resolve_level(key, priority, tier) == level


def test_priority_fields_are_accepted_on_every_route_and_odd_ones_refused(
    client: TestClient, tiny_embedder_dir: Path, tiny_llm_dir: Path
) -> None:
    register(client, "emb", "embedder", tiny_embedder_dir)
    register(client, "tiny", "llm", tiny_llm_dir)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for extra in ({"priority": "batch"}, {"priority": 3}, {"service_tier": "flex"}):
        r = client.post("/v1/chat/completions", json={**chat, **extra})
        assert r.status_code == 200, (extra, r.text)
    r = client.post("/v1/embeddings", json={"model": "emb", "input": "hi", "priority": "batch"})
    assert r.status_code == 200, r.text
    for path, body in [
        ("/v1/chat/completions", {**chat, "priority": "urgent"}),
        ("/v1/embeddings", {"model": "emb", "input": "hi", "priority": "high"}),
        ("/v1/embeddings", {"model": "emb", "input": "hi", "priority": 2**63}),
    ]:
        r = client.post(path, json=body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert "priority" in (error["param"] or "") + error["message"], error
