"""Embeddings over HTTP: registry -> manager -> batched embedder backend -> OpenAI's shape,
with token-id inputs, `dimensions`, bad input, a full queue and the official openai client."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

SENTENCES = ["a short one", "a much longer sentence about paged attention and memory budgets", "x"]


def register(client: TestClient, name: str, kind: str, source: Path, **extra: object) -> int:
    r = client.post(
        "/admin/registry/models", json={"name": name, "kind": kind, "source": str(source), **extra}
    )
    assert r.status_code == 201, r.text
    return int(r.json()["version"])


def st_encode(folder: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return np.asarray(SentenceTransformer(str(folder), device="cpu").encode(texts))


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.sum(a * b, axis=1)


def test_embeddings_match_sentence_transformers(
    client: TestClient, tiny_embedder_dir: Path
) -> None:
    assert register(client, "emb", "embedder", tiny_embedder_dir) == 1
    r = client.post("/v1/embeddings", json={"model": "emb", "input": SENTENCES})
    assert r.status_code == 200, r.text
    assert r.headers["X-Hub-Model-Version"] == "1"
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    assert cosine(got, st_encode(tiny_embedder_dir, SENTENCES)).min() >= 0.9999
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > len(SENTENCES)


def test_base64_and_single_string_and_per_model_routes(
    client: TestClient, tiny_embedder_dir: Path
) -> None:
    register(client, "emb", "embedder", tiny_embedder_dir)
    register(client, "emb", "embedder", tiny_embedder_dir)
    floats = client.post("/v1/embeddings", json={"model": "emb@1", "input": "hello"}).json()
    b64 = client.post(
        "/v1/embeddings", json={"model": "emb@1", "input": "hello", "encoding_format": "base64"}
    ).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, floats["data"][0]["embedding"], rtol=1e-6)
    routed = client.post("/models/emb/embed", json={"input": ["hello"]})
    assert routed.headers["X-Hub-Model-Version"] == "2"  # latest, no production alias
    pinned = client.post("/models/emb/versions/1/embed", json={"input": ["hello"]})
    assert pinned.headers["X-Hub-Model-Version"] == "1"
    np.testing.assert_allclose(pinned.json()["data"][0]["embedding"], decoded, rtol=1e-5)


def test_production_alias_is_served_over_latest(
    client: TestClient, tiny_embedder_dir: Path, tiny_embedder_v2_dir: Path
) -> None:
    register(client, "emb", "embedder", tiny_embedder_dir, aliases=["production"])
    register(client, "emb", "embedder", tiny_embedder_v2_dir)
    r = client.post("/v1/embeddings", json={"model": "emb", "input": "hi"})
    assert r.headers["X-Hub-Model-Version"] == "1"
    r = client.post("/v1/embeddings", json={"model": "emb@production", "input": "hi"})
    assert r.headers["X-Hub-Model-Version"] == "1"
    models = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["kind"], m["default_version"]) for m in models] == [("emb", "embedder", 1)]


def test_unknown_model_lists_known_names(client: TestClient, tiny_embedder_dir: Path) -> None:
    register(client, "emb", "embedder", tiny_embedder_dir)
    r = client.post("/v1/embeddings", json={"model": "nope", "input": "hi"})
    assert r.status_code == 404
    assert "known models: emb" in r.json()["error"]["message"]
    r = client.post("/v1/embeddings", json={"model": "emb@9", "input": "hi"})
    assert r.status_code == 404 and "versions: 1" in r.json()["error"]["message"]


def test_embeddings_of_a_non_embedder_is_400(client: TestClient, tiny_reranker_dir: Path) -> None:
    register(client, "rr", "reranker", tiny_reranker_dir)
    r = client.post("/v1/embeddings", json={"model": "rr", "input": "hi"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert "is a reranker" in err["message"] and err["param"] == "model"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": "hi"}, "model"),
        ({"model": "emb"}, "input"),
        ({"model": "emb", "input": []}, "input"),
        ({"model": "emb", "input": "hi", "encoding_format": "hex"}, "encoding_format"),
        ({"model": "emb", "input": "hi", "dimensions": 0}, "dimensions"),
        ({"model": "emb", "input": [1.5]}, "input"),
        ({"model": "emb", "input": ["a", 3]}, "input[1] is int; every item must be a string"),
        ({"model": "emb", "input": ["a", ""]}, "input[1] is an empty string"),
        ({"model": "emb", "input": ""}, "input must not be an empty string"),
        ({"model": "emb", "input": [[1, 2], []]}, "input[1] is an empty list"),
        ({"model": "emb", "input": [[1, 2], [3, "x"]]}, "input[1] holds str"),
        ({"model": "emb", "input": [1, True]}, "input[1] is bool; token ids must be integers"),
        ({"model": "emb", "input": {"text": "hi"}}, "input must be a string, a list of strings"),
    ],
)
def test_malformed_bodies_get_400_naming_the_field(
    client: TestClient, body: dict[str, object], field: str
) -> None:
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 400
    assert field in r.json()["error"]["message"]


def test_truncate_false_refuses_long_input(client: TestClient, tiny_embedder_dir: Path) -> None:
    register(client, "emb", "embedder", tiny_embedder_dir)
    long = "word " * 1000
    ok = client.post("/v1/embeddings", json={"model": "emb", "input": ["short", long]})
    assert ok.status_code == 200
    r = client.post(
        "/v1/embeddings", json={"model": "emb", "input": ["short", long], "truncate": False}
    )
    assert r.status_code == 400 and "input[1]" in r.json()["error"]["message"]
    # The model's own refusal names the version that refused, like every answer.
    assert r.headers["X-Hub-Model-Version"] == ok.headers["X-Hub-Model-Version"] == "1"


def test_register_refusals_via_api(client: TestClient, tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "pytorch_model.bin").write_bytes(b"not really")
    (tmp_path / "w" / "tokenizer.json").write_text("{}")
    r = client.post(
        "/admin/registry/models",
        json={"name": "m", "kind": "embedder", "source": str(tmp_path / "w")},
    )
    assert r.status_code == 400 and "pickle" in r.json()["error"]["message"]
    r = client.post("/admin/registry/models", json={"name": "m", "kind": "toaster", "source": "x"})
    assert r.status_code == 400 and "kind" in r.json()["error"]["message"]
    assert client.get("/v1/models").json()["data"] == []


def test_admin_load_unload_and_status(client: TestClient, tiny_embedder_dir: Path) -> None:
    register(client, "emb", "embedder", tiny_embedder_dir)
    assert client.get("/admin/models").json() == []
    r = client.post("/admin/models/emb/versions/1/load")
    assert r.status_code == 200 and r.json()["state"] == "loaded"
    [status] = client.get("/admin/models").json()
    assert status["measured_bytes"] > 0 and status["device"] == "cpu"
    [device] = client.get("/admin/devices").json()["devices"]
    assert device["used_bytes"] >= status["measured_bytes"]
    r = client.post("/admin/models/emb/versions/1/unload")
    assert r.json()["state"] == "unloaded"
    assert client.get("/admin/devices").json()["devices"][0]["used_bytes"] == 0
    # The next request loads it again.
    assert client.post("/v1/embeddings", json={"model": "emb", "input": "hi"}).status_code == 200


def test_health_and_metrics(client: TestClient, tiny_embedder_dir: Path) -> None:
    assert client.get("/health/live").json() == {"status": "ok"}
    assert client.get("/health/ready").json()["status"] == "ready"
    register(client, "emb", "embedder", tiny_embedder_dir)
    client.post("/v1/embeddings", json={"model": "emb", "input": "hi"})
    text = client.get("/metrics").text
    assert (
        'hub_requests_total{endpoint="embeddings",model="emb",status="200",version="1"} 1.0' in text
    )
    # The batcher's own metrics, per model and version.
    assert 'hub_batch_size_count{model="emb",version="1"} 1.0' in text
    assert 'hub_batch_queue_seconds_count{model="emb",version="1"} 1.0' in text
    assert "Model Hub" in client.get("/").text


def test_token_id_inputs_embed_like_their_text(client: TestClient, tiny_embedder_dir: Path) -> None:
    from transformers import AutoTokenizer

    register(client, "emb", "embedder", tiny_embedder_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_embedder_dir)
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in SENTENCES]
    texts = client.post("/v1/embeddings", json={"model": "emb", "input": SENTENCES}).json()
    lists = client.post("/v1/embeddings", json={"model": "emb", "input": ids}).json()
    one = client.post("/v1/embeddings", json={"model": "emb", "input": ids[1]}).json()
    want = np.array([d["embedding"] for d in texts["data"]])
    assert cosine(np.array([d["embedding"] for d in lists["data"]]), want).min() >= 0.9999
    assert cosine(np.array([one["data"][0]["embedding"]]), want[1:2]).min() >= 0.9999
    assert lists["usage"] == texts["usage"]
    r = client.post("/v1/embeddings", json={"model": "emb", "input": [[1, 2], [3, 10**6]]})
    assert r.status_code == 400
    assert "input[1] holds token id 1000000" in r.json()["error"]["message"]


def test_dimensions_where_the_model_allows_else_400(
    client: TestClient, tiny_embedder_dir: Path
) -> None:
    register(client, "plain", "embedder", tiny_embedder_dir)
    register(client, "nested", "embedder", tiny_embedder_dir, config={"matryoshka_dims": [16]})
    r = client.post("/v1/embeddings", json={"model": "plain", "input": "hi", "dimensions": 16})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "dimensions" and "16" in r.json()["error"]["message"]
    full = client.post("/v1/embeddings", json={"model": "nested", "input": "hi"}).json()
    r = client.post("/v1/embeddings", json={"model": "nested", "input": "hi", "dimensions": 16})
    short = np.array(r.json()["data"][0]["embedding"])
    head = np.array(full["data"][0]["embedding"][:16])
    np.testing.assert_allclose(short, head / np.linalg.norm(head), rtol=1e-5)


async def test_full_queue_is_503_with_retry_after(
    app_client: tuple[FastAPI, httpx.AsyncClient], tiny_embedder_dir: Path
) -> None:
    app, client = app_client
    body = {"name": "emb", "kind": "embedder", "source": str(tiny_embedder_dir),
            "config": {"max_queue": 3, "max_batch_size": 1, "forward_workers": 1}}  # fmt: skip
    assert (await client.post("/admin/registry/models", json=body)).status_code == 201
    assert (await client.post("/models/emb/embed", json={"input": "warm"})).status_code == 200
    async with app.state.hub.manager.acquire("emb", 1) as backend:
        parked = ParkedForward(backend)
        try:
            first = asyncio.create_task(client.post("/models/emb/embed", json={"input": "a"}))
            await asyncio.to_thread(parked.entered.wait, 30)
            waiting = asyncio.create_task(
                client.post("/models/emb/embed", json={"input": ["b", "c"]})
            )
            await until_queued(backend, 2)
            r = await client.post("/v1/embeddings", json={"model": "emb", "input": ["d", "e"]})
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
            assert "2 inputs already wait" in r.json()["error"]["message"]
            r = await client.post("/v1/embeddings", json={"model": "emb", "input": ["x"] * 4})
            assert r.status_code == 400 and "max_queue" in r.json()["error"]["message"]
        finally:
            parked.release()
    assert (await first).status_code == 200 and (await waiting).status_code == 200
    metrics = (await client.get("/metrics")).text
    assert 'endpoint="embeddings",model="emb",status="503",version="1"} 1.0' in metrics


async def test_a_client_that_leaves_has_its_queued_inputs_dropped(
    app_client: tuple[FastAPI, httpx.AsyncClient], tiny_embedder_dir: Path
) -> None:
    app, client = app_client
    body = {"name": "emb", "kind": "embedder", "source": str(tiny_embedder_dir),
            "config": {"max_batch_size": 1, "forward_workers": 1}}  # fmt: skip
    assert (await client.post("/admin/registry/models", json=body)).status_code == 201
    assert (await client.post("/models/emb/embed", json={"input": "warm"})).status_code == 200
    batched_before = batch_inputs(await client.get("/metrics"))
    async with app.state.hub.manager.acquire("emb", 1) as backend:
        parked = ParkedForward(backend)
        try:
            first = asyncio.create_task(client.post("/models/emb/embed", json={"input": "a"}))
            await asyncio.to_thread(parked.entered.wait, 30)
            # A raw ASGI request whose client disconnects while its inputs wait in the queue.
            leave = asyncio.Event()
            request_body = json.dumps({"input": ["left", "behind", "here"]}).encode()
            messages = [{"type": "http.request", "body": request_body, "more_body": False}]

            async def receive() -> dict[str, Any]:
                if messages:
                    return messages.pop(0)
                await leave.wait()
                return {"type": "http.disconnect"}

            sent: list[dict[str, Any]] = []

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            scope = {
                "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                "method": "POST", "scheme": "http", "path": "/models/emb/embed",
                "raw_path": b"/models/emb/embed", "query_string": b"", "root_path": "",
                "headers": [(b"content-type", b"application/json")],
                "client": ("127.0.0.1", 1), "server": ("hub", 80), "state": {},
            }  # fmt: skip
            abandoned = asyncio.create_task(app(scope, receive, send))
            await until_queued(backend, 3)
            leave.set()
            await abandoned
            assert sent[0]["status"] == 499
            # Dropped from the queue (at once, or as the tokenizer thread hands them over).
            await until_queued(backend, 0, at_most=True)
        finally:
            parked.release()
    assert (await first).status_code == 200
    metrics = await client.get("/metrics")
    # Only "a" ran after the warm-up; the three abandoned inputs never reached the model.
    assert batch_inputs(metrics) == batched_before + 1
    assert 'endpoint="embeddings",model="emb",status="499",version="1"} 1.0' in metrics.text


def batch_inputs(metrics: httpx.Response) -> float:
    """Inputs the model `emb` has run, from the hub's batch-size histogram."""
    for line in metrics.text.splitlines():
        if line.startswith('hub_batch_size_sum{model="emb",version="1"}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no hub_batch_size_sum for emb")


async def test_official_openai_client(
    app_client: tuple[FastAPI, httpx.AsyncClient], tiny_embedder_dir: Path
) -> None:
    import openai

    _, client = app_client
    body = {"name": "emb", "kind": "embedder", "source": str(tiny_embedder_dir)}
    assert (await client.post("/admin/registry/models", json=body)).status_code == 201
    oai = openai.AsyncOpenAI(base_url="http://hub/v1", api_key="unused", http_client=client)
    # The client asks for base64 by default and decodes it; concurrent calls share batches.
    results = await asyncio.gather(
        *(oai.embeddings.create(model="emb", input=[s]) for s in SENTENCES)
    )
    got = np.array([r.data[0].embedding for r in results], dtype=np.float32)
    assert cosine(got, st_encode(tiny_embedder_dir, SENTENCES)).min() >= 0.9999
    floats = await oai.embeddings.create(model="emb", input=SENTENCES, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.usage.total_tokens > 3
    with pytest.raises(openai.BadRequestError, match="cannot be truncated to 3"):
        await oai.embeddings.create(model="emb", input="hi", dimensions=3)


class ParkedForward:
    """Parks the backend's forward passes until `release()`; `entered` is set once one is.
    (The stages the batcher runs: their passes go on to the worker processes, if any.)"""

    def __init__(self, backend: Any) -> None:
        self._stages = backend._batcher.stages
        self._forward = self._stages.forward
        self.entered = threading.Event()
        self._released = threading.Event()
        self._stages.forward = self._parked

    def _parked(self, items: Any) -> Any:
        self.entered.set()
        self._released.wait(30)
        return self._forward(items)

    def release(self) -> None:
        self._stages.forward = self._forward
        self._released.set()


async def until_queued(backend: Any, n: int, *, at_most: bool = False) -> None:
    """Until `n` inputs (or, `at_most`, no more than `n`) wait in the backend's batcher."""

    def poll() -> None:
        queued = backend._batcher.queued
        while queued > n if at_most else queued < n:
            time.sleep(0.005)
            queued = backend._batcher.queued

    await asyncio.wait_for(asyncio.to_thread(poll), 30)


def test_inference_routes_need_a_user_key_when_auth_is_on(
    tmp_path: Path, mlflow_template: Path, tiny_embedder_dir: Path, tiny_reranker_dir: Path
) -> None:
    from hub.app import create_app
    from tests.support.hubs import ADMIN as admin
    from tests.support.hubs import auth_settings

    settings, user_key = auth_settings(tmp_path / "hub", mlflow_template)
    with TestClient(create_app(settings)) as client:
        for name, kind, source in [("emb", "embedder", tiny_embedder_dir),
                                   ("rr", "reranker", tiny_reranker_dir)]:  # fmt: skip
            body = {"name": name, "kind": kind, "source": str(source)}
            r = client.post("/admin/registry/models", json=body, headers=admin)
            assert r.status_code == 201
        calls = [
            ("/v1/embeddings", {"model": "emb", "input": "hi"}),
            ("/models/emb/embed", {"input": "hi"}),
            ("/models/emb/versions/1/embed", {"input": "hi"}),
            ("/v1/rerank", {"model": "rr", "query": "q", "documents": ["d"]}),
            ("/models/rr/rerank", {"query": "q", "documents": ["d"]}),
            ("/models/rr/versions/1/rerank", {"query": "q", "documents": ["d"]}),
        ]
        for path, body in calls:
            r = client.post(path, json=body)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", path
            r = client.post(path, json=body, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401, path
            r = client.post(path, json=body, headers={"X-API-Key": user_key})
            assert r.status_code == 200, (path, r.text)


def test_openapi_documents_the_request_bodies(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for path, fields in [
        ("/v1/embeddings", {"model", "input", "encoding_format", "dimensions", "truncate"}),
        ("/models/{name}/embed", {"input", "dimensions"}),
        ("/v1/rerank", {"model", "query", "documents", "top_n", "return_documents"}),
        ("/models/{name}/versions/{version}/rerank", {"query", "documents"}),
    ]:
        post = paths[path]["post"]
        schema = post["requestBody"]["content"]["application/json"]["schema"]
        assert fields <= set(schema["properties"]), path
        assert "$ref" not in str(schema["properties"]), path  # definitions are inlined
        assert "200" in post["responses"]


def test_openapi_documents_validation_errors_as_the_400_the_hub_sends(
    client: TestClient,
) -> None:
    doc = client.get("/openapi.json").json()
    automatic_422 = [
        f"{method.upper()} {path}"
        for path, operations in doc["paths"].items()
        for method, operation in operations.items()
        if "HTTPValidationError" in str(operation.get("responses", {}).get("422", ""))
    ]
    assert automatic_422 == []
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    embeddings = doc["paths"]["/v1/embeddings"]["post"]["responses"]
    assert embeddings["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ErrorResponse"
    )
    # A bad body really is that 400, in the documented shape.
    r = client.post("/v1/embeddings", json={"model": "x", "input": "y", "bogus": 1})
    assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type", "param"}
