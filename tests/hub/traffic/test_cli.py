"""`hub traffic`, `hub canary` and `hub readout` against a hub: parsing, output, errors.

The commands speak HTTP to a running hub; here that hub is the in-process app behind
Starlette's TestClient, which `httpx.request` is pointed at."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from hub.cli import app
from tests.hub.api.test_embeddings import register

runner = CliRunner()


@pytest.fixture
def hub_cli(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, tiny_embedder_dir: Path,
    tiny_embedder_v2_dir: Path,
) -> TestClient:  # fmt: skip
    register(client, "emb", "embedder", tiny_embedder_dir, aliases=["production"])
    register(client, "emb", "embedder", tiny_embedder_v2_dir)

    def request(method: str, url: str, **kwargs: Any) -> httpx.Response:
        kwargs.pop("timeout", None)
        return client.request(method, url.removeprefix("http://hub.test"), **kwargs)

    monkeypatch.setattr(httpx, "request", request)  # hub.cli_remote calls it
    return client


def hub(*args: str) -> Any:
    return runner.invoke(app, [*args, "--url", "http://hub.test"])


def test_traffic_set_get_clear(hub_cli: TestClient) -> None:
    result = hub("traffic", "set", "emb", "--split", "1=90", "--split", "2=10",
                 "--shadow", "2=5", "--fault", "2=50:20ms")  # fmt: skip
    assert result.exit_code == 0, result.output
    policy = json.loads(result.stdout)
    assert [(s["label"], s["weight"]) for s in policy["splits"]] == [("1", 90.0), ("2", 10.0)]
    assert policy["shadow"]["percent"] == 5.0
    assert policy["faults"][0] == {"version": 2, "error_percent": 50.0, "delay_ms": 20.0,
                                   "model": "emb"}  # fmt: skip
    assert json.loads(hub("traffic", "get", "emb").stdout)["revision"] == 1

    refused = hub("traffic", "set", "emb", "--split", "1=90")
    assert refused.exit_code == 1 and "weights must sum to 100" in refused.output
    malformed = hub("traffic", "set", "emb", "--split", "one=90")
    assert malformed.exit_code == 2 and "expected [MODEL@]VERSION=NUMBER" in malformed.output

    cleared = hub("traffic", "clear", "emb")
    assert cleared.exit_code == 0 and json.loads(cleared.stdout)["default"] is True


def test_canary_start_status_abort_and_readout(hub_cli: TestClient) -> None:
    args = ["canary", "start", "emb", "--version", "2", "--steps", "10,50,100",
            "--interval", "1h", "--min-requests", "20"]  # fmt: skip
    refused = hub(*args)
    assert refused.exit_code == 1 and "409" in refused.output
    assert "has not passed staging" in refused.output
    r = hub_cli.post("/admin/registry/models/emb/versions/2/promote", json={"to": "staging"})
    assert r.status_code == 200
    started = hub(*args)
    assert started.exit_code == 0, started.output
    doc = json.loads(started.stdout)
    assert (doc["steps"], doc["interval_s"], doc["min_requests"]) == ([10, 50, 100], 3600, 20)

    status = json.loads(hub("canary", "status", "emb").stdout)
    assert (status["state"], status["weight"]) == ("running", 10)
    aborted = hub("canary", "abort", "emb", "--reason", "not today")
    assert aborted.exit_code == 0 and json.loads(aborted.stdout)["state"] == "aborted"

    hub_cli.post("/v1/embeddings", json={"model": "emb", "input": "hi"})
    readout = json.loads(hub("readout", "emb").stdout)
    assert readout["canary"]["reason"].endswith("not today")
    assert {v["version"] for v in readout["versions"]} >= {"1"}
    missing = hub("readout", "ghost")
    assert missing.exit_code == 1 and "404" in missing.output
