"""Usage metering over HTTP: what `GET /admin/usage` reports per key and model equals what
the clients were told in their answers' `usage` fields, for chat (plain and streamed),
completions, generate, responses, embeddings and rerank in its shapes (TEI's too, which tells
no usage); errors are counted; the route needs an admin key and refuses bad filters;
Prometheus counts by key; the dashboard has its panel."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from hub.app import create_app
from registry.db import Database
from registry.keys import ApiKeys
from tests.support.hubs import ADMIN, auth_settings

MESSAGES = [{"role": "user", "content": "Hi there, how are you?"}]
DOCUMENTS = ["a cat sat on the mat", "stock prices fell", "the kitten slept"]


def sse_usage(text: str) -> dict[str, Any]:
    """The `usage` of a streamed answer's usage event (the last event that has one)."""
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    usage: dict[str, Any] = [e["usage"] for e in events if e.get("usage")][-1]
    return usage


def test_usage_equals_what_clients_were_told(
    tmp_path: Path,
    mlflow_template: Path,
    tiny_llm_dir: Path,
    tiny_embedder_dir: Path,
    tiny_reranker_dir: Path,
) -> None:
    settings, app_key = auth_settings(tmp_path / "hub", mlflow_template)
    batch_key, _ = ApiKeys(Database(settings.database_url)).create("batch", "user")
    app, batch = {"Authorization": f"Bearer {app_key}"}, {"X-API-Key": batch_key}
    # What each (key, model) was told: prompt and completion tokens, and requests.
    told: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])

    def tell(key: str, model: str, prompt: int, completion: int = 0) -> None:
        t = told[(key, model)]
        t[0], t[1], t[2] = t[0] + prompt, t[1] + completion, t[2] + 1

    with TestClient(create_app(settings)) as client:
        for name, kind, source in (
            ("tiny", "llm", tiny_llm_dir),
            ("emb", "embedder", tiny_embedder_dir),
            ("rr", "reranker", tiny_reranker_dir),
        ):
            r = client.post(
                "/admin/registry/models",
                headers=ADMIN,
                json={"name": name, "kind": kind, "source": str(source)},
            )
            assert r.status_code == 201, r.text

        chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
        r = client.post("/v1/chat/completions", headers=app, json=chat)
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        tell("app", "tiny", u["prompt_tokens"], u["completion_tokens"])
        streamed = {**chat, "stream": True, "stream_options": {"include_usage": True}}
        r = client.post("/v1/chat/completions", headers=app, json=streamed)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
        u = sse_usage(r.text)
        tell("app", "tiny", u["prompt_tokens"], u["completion_tokens"])
        r = client.post(
            "/models/tiny/generate",
            headers=batch,
            json={"prompt": "once upon", "max_tokens": 5, "stream": True},
        )
        u = sse_usage(r.text)
        tell("batch", "tiny", u["prompt_tokens"], u["completion_tokens"])
        r = client.post(
            "/v1/completions",
            headers=batch,
            json={"model": "tiny", "prompt": ["a b", "c d e"], "max_tokens": 3},
        )
        u = r.json()["usage"]
        tell("batch", "tiny", u["prompt_tokens"], u["completion_tokens"])
        # Over the context: refused by the engine after the model was reached, an error.
        r = client.post(
            "/v1/completions",
            headers=batch,
            json={"model": "tiny", "prompt": "x " * 5000, "max_tokens": 3},
        )
        assert r.status_code == 400
        told[("batch", "tiny")][2] += 1

        respond = {"model": "tiny", "input": "Hello", "max_output_tokens": 4}
        r = client.post("/v1/responses", headers=app, json=respond)
        u = r.json()["usage"]
        tell("app", "tiny", u["input_tokens"], u["output_tokens"])

        r = client.post("/v1/embeddings", headers=app, json={"model": "emb", "input": ["a", "b c"]})
        tell("app", "emb", r.json()["usage"]["prompt_tokens"])
        embedded_tokens = r.json()["usage"]["prompt_tokens"]
        r = client.post("/models/emb/embed", headers=batch, json={"input": "one more"})
        tell("batch", "emb", r.json()["usage"]["prompt_tokens"])
        embedded_tokens += r.json()["usage"]["prompt_tokens"]

        r = client.post(
            "/v1/rerank", headers=app, json={"model": "rr", "query": "cat", "documents": DOCUMENTS}
        )
        pairs = r.json()["usage"]["prompt_tokens"]
        tell("app", "rr", pairs)
        r = client.post(
            "/v2/rerank",
            headers=app,
            json={"model": "rr", "query": "cat", "documents": DOCUMENTS[:2]},
        )
        tell("app", "rr", r.json()["meta"]["tokens"]["input_tokens"])
        # TEI's shape tells no usage; the same pairs as the first rerank are as many tokens.
        r = client.post("/rerank", headers=batch, json={"query": "cat", "texts": DOCUMENTS})
        assert r.status_code == 200, r.text
        tell("batch", "rr", pairs)

        r = client.get("/admin/usage", headers=ADMIN)
        assert r.status_code == 200, r.text
        rows = r.json()
        got = {
            (row["key"], row["model"]): [
                row["prompt_tokens"],
                row["completion_tokens"],
                row["requests"],
            ]
            for row in rows
        }
        assert got == dict(told)
        assert {row["version"] for row in rows} == {1}
        by = {(row["key"], row["model"]): row for row in rows}
        assert by[("batch", "tiny")]["errors"] == 1 and by[("app", "tiny")]["errors"] == 0
        assert by[("app", "emb")]["embedded_inputs"] == 2
        assert by[("app", "emb")]["embedded_tokens"] + by[("batch", "emb")]["embedded_tokens"] == (
            embedded_tokens
        )
        assert by[("app", "rr")]["rerank_documents"] == 5
        assert by[("batch", "rr")]["rerank_documents"] == 3

        # Filters and grouping.
        r = client.get("/admin/usage?key=batch&group_by=key", headers=ADMIN)
        [total] = r.json()
        assert total["key"] == "batch" and total["model"] is None
        assert total["requests"] == sum(v[2] for (k, _), v in told.items() if k == "batch")
        r = client.get("/admin/usage?model=emb&group_by=hour", headers=ADMIN)
        [hourly] = r.json()
        assert hourly["hour"] is not None and hourly["requests"] == 2
        assert client.get("/admin/usage?since=2999-01-01T00:00:00Z", headers=ADMIN).json() == []

        # Admin only; bad filters are 400s in OpenAI's shape.
        assert client.get("/admin/usage", headers=app).status_code == 403
        r = client.get("/admin/usage?group_by=key,colour", headers=ADMIN)
        assert r.status_code == 400 and r.json()["error"]["param"] == "group_by"
        r = client.get("/admin/usage?since=yesterday", headers=ADMIN)
        assert r.status_code == 400 and r.json()["error"]["param"] == "since"

        metrics = client.get("/metrics").text
        assert 'hub_usage_requests_total{key="app",model="emb"} 1.0' in metrics
        completion = told[("app", "tiny")][1]
        assert f'hub_usage_completion_tokens_total{{key="app",model="tiny"}} {completion}.0' in (
            metrics
        )
        assert "/admin/usage" in client.get("/").text  # the dashboard's usage panel
