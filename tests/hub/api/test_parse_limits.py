"""Input the hub cannot parse as asked is a 4xx naming the problem, never a 500 nor a 200:
JSON nested too deep in a body, a webhook or a source's config.json (the limit named); a
register `source` holding a NUL byte, a name too long, or a symlink loop; a checkpoint that
lacks weights its config needs; a keep_alive out of range; headers too large or too many."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from hub.api.header_limits import MAX_HEADER_BYTES, MAX_HEADER_COUNT
from registry.bounded_json import MAX_JSON_DEPTH
from tests.hub.api.test_webhook_hardening import _headers
from tests.hub.api.test_webhooks import slow_poll_client  # noqa: F401
from tests.support.checkpoints import drop_tensor
from tests.support.hubs import make_settings
from tests.support.live import live_hub


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _refused(r: httpx.Response, status: int = 400) -> str:
    assert r.status_code == status, r.text[:500]
    message = str(r.json()["error"]["message"])
    assert len(message) < 500  # the body is never echoed back
    return message


def test_a_deeply_nested_rerank_body_is_a_400_and_the_connection_lives_on(
    tmp_path: Path, mlflow_template: Path
) -> None:
    body = b'{"model": "m", "query": "q", "documents": ' + nested(1000) + b"}"
    settings = make_settings(tmp_path / "hub", mlflow_template)
    with live_hub(settings) as (url, _), httpx.Client(base_url=url, timeout=30) as client:
        for path in ("/rerank", "/v1/rerank", "/v1/embeddings", "/v1/chat/completions"):
            r = client.post(path, content=body, headers={"Content-Type": "application/json"})
            assert f"{MAX_JSON_DEPTH} levels" in _refused(r), path
        # The same keep-alive connection still answers.
        assert client.get("/health/live").status_code == 200


def test_a_body_just_within_the_depth_limit_is_parsed(client: TestClient) -> None:
    # Within the limit the body is read as usual: the answer is about the model, not depth.
    inner = nested(MAX_JSON_DEPTH - 2)
    body = b'{"model": "nope", "input": "x", "user": {"a": ' + inner + b"}}"
    r = client.post("/v1/embeddings", content=body, headers={"Content-Type": "application/json"})
    assert "levels" not in r.text


def test_a_signed_webhook_nested_100k_deep_is_a_400(
    slow_poll_client: TestClient,  # noqa: F811
) -> None:
    raw = b'{"entity": "model_version_alias", "data": ' + nested(100_000) + b"}"
    r = slow_poll_client.post("/webhooks/mlflow", content=raw, headers=_headers(raw))
    assert f"{MAX_JSON_DEPTH} levels" in _refused(r)


def _register(client: TestClient, source: str, kind: str = "reranker") -> httpx.Response:
    return client.post("/admin/registry/models", json={"name": "m", "kind": kind, "source": source})


def test_a_config_nested_100k_deep_is_refused_at_registration(
    client: TestClient, tiny_reranker_dir: Path, tmp_path: Path
) -> None:
    folder = shutil.copytree(tiny_reranker_dir, tmp_path / "deep")
    config = json.loads((folder / "config.json").read_text())
    text = json.dumps({**config, "extra": "HOLE"})
    (folder / "config.json").write_text(text.replace('"HOLE"', nested(100_000).decode()))
    message = _refused(_register(client, str(folder)))
    assert "config.json" in message and f"{MAX_JSON_DEPTH} levels" in message


def test_a_symlink_loop_in_or_as_the_source_is_refused_naming_it(
    client: TestClient, tiny_reranker_dir: Path, tmp_path: Path
) -> None:
    folder = shutil.copytree(tiny_reranker_dir, tmp_path / "looped")
    os.symlink("l", folder / "l")  # ln -s l l
    message = _refused(_register(client, str(folder)))
    assert "l in source" in message and "symlink loop" in message
    os.symlink("self", tmp_path / "self")
    assert "symlink loop" in _refused(_register(client, str(tmp_path / "self")))


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("/tmp/model\x00/x", "NUL byte"),
        ("/tmp/" + "a" * 300, "255 bytes"),
        ("/tmp/" + "a/" * 3000, "4096"),
    ],
)
def test_a_source_no_path_can_be_is_refused_naming_why(
    client: TestClient, source: str, words: str
) -> None:
    assert words in _refused(_register(client, source))


@pytest.mark.parametrize("keep_alive", ["99999999999999999999h", "-5m", -2, "-0.5", 1e299])
def test_a_keep_alive_out_of_range_is_a_400_naming_it(
    client: TestClient, keep_alive: object
) -> None:
    bodies = {
        "/v1/embeddings": {"model": "nope", "input": "x"},
        "/v1/rerank": {"model": "nope", "query": "q", "documents": ["d"]},
        "/v1/chat/completions": {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
    }
    for path, body in bodies.items():
        r = client.post(path, json={**body, "keep_alive": keep_alive})
        assert "keep_alive" in _refused(r), path
    r = _register_with(client, {"keep_alive": keep_alive})
    assert "keep_alive" in _refused(r)


@pytest.mark.parametrize("keep_alive", [-1, "-1", "5m", 0, "365d"])
def test_a_keep_alive_in_range_is_taken(client: TestClient, keep_alive: object) -> None:
    r = client.post(
        "/v1/embeddings", json={"model": "nope", "input": "x", "keep_alive": keep_alive}
    )
    assert r.status_code == 404, r.text  # past validation: the model is what is missing


def _register_with(client: TestClient, config: dict[str, object]) -> httpx.Response:
    return client.post(
        "/admin/registry/models",
        json={"name": "m", "kind": "embedder", "source": "/nonexistent", "config": config},
    )


def _with_config(src: Path, dest: Path, **changes: object) -> Path:
    folder = shutil.copytree(src, dest)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


def test_a_config_the_checkpoint_does_not_cover_is_refused_at_registration(
    client: TestClient, tiny_llm_dir: Path, tiny_reranker_dir: Path, tmp_path: Path
) -> None:
    # 1,024 layers declared over a 2-layer checkpoint: 9,198 weights would be random.
    folder = _with_config(tiny_llm_dir, tmp_path / "llm", num_hidden_layers=1024)
    message = _refused(_register(client, str(folder), kind="llm"))
    assert "lacks 9198 of the 9219 weights" in message and "1024 layers" in message
    assert "model.layers.2." in message
    # A reranker whose config names a deeper encoder than its checkpoint holds.
    folder = _with_config(tiny_reranker_dir, tmp_path / "rr", num_hidden_layers=6)
    assert "lacks" in _refused(_register(client, str(folder)))
    assert client.get("/admin/registry/models/m/versions").status_code == 404


def test_a_tied_head_or_a_matching_config_registers(
    client: TestClient, tiny_llm_dir: Path, tmp_path: Path
) -> None:
    # The checkpoint holds the embedding once; with tie_word_embeddings the head shares it.
    folder = _with_config(tiny_llm_dir, tmp_path / "tied", tie_word_embeddings=True)
    drop_tensor(folder / "model.safetensors", "lm_head.weight")
    r = _register(client, str(folder), kind="llm")
    assert r.status_code == 201, r.text


def _raw_request(url: str, path: str, headers: list[bytes]) -> tuple[int, dict[str, str]]:
    """POST `{}` to `path` over a plain socket with `headers` (b"name: value" lines), as an
    attacker's client would send them; the status and JSON body of the answer."""
    host, port = url.removeprefix("http://").split(":")
    head = [f"POST {path} HTTP/1.1".encode(), f"Host: {host}".encode(), *headers]
    head += [b"Content-Type: application/json", b"Content-Length: 2"]
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"\r\n".join(head) + b"\r\n\r\n{}")
        answer = b""
        while chunk := s.recv(65536):  # the server closes the connection after a 431
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    body = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(body) if body.startswith(b"{") else {}


def test_oversized_or_countless_headers_are_a_431_from_a_real_server(
    tmp_path: Path, mlflow_template: Path
) -> None:
    big = [b"X-Big: " + b"a" * (5 * 2**20)]
    many = [b"x-h%d: v" % i for i in range(100_000)]
    settings = make_settings(tmp_path / "hub", mlflow_template)
    with live_hub(settings) as (url, _):
        for path in ("/health/live", "/v1/embeddings", "/admin/models"):
            status, body = _raw_request(url, path, big)
            assert status == 431 and f"at most {MAX_HEADER_BYTES}" in body["error"]["message"]
            status, body = _raw_request(url, path, many)
            assert status == 431 and f"at most {MAX_HEADER_COUNT}" in body["error"]["message"]
        # Ordinary requests with a good many headers are served as before.
        with httpx.Client(base_url=url, timeout=60) as client:
            r = client.get("/health/live", headers=[(f"x-h{i}", "v" * 100) for i in range(100)])
            assert r.status_code == 200
