"""schemathesis over the hub's own `/openapi.json`: every operation, fed generated input with a
fixed seed against an in-process app with tiny models registered, never answers a server
error and always answers what its schema documents."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.hub.api.test_embeddings import register

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES = 25
SEED = 16

# Not fuzzed: registration copies and hashes whatever folder a generated `source` names (`/`
# would be the whole filesystem); the three registrations above exercise it.
SKIPPED = {"POST /admin/registry/models"}


# Generation kept short so the LLM routes run many examples quickly.
MAX_TOKENS = 4
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n", "best_of")


def _model_for(path: str) -> str:
    if "embed" in path:
        return "emb"
    if "rerank" in path:
        return "rr"
    return "llm"


def _steer(case: Any) -> Any:
    """Half the generated cases name a registered model (and version 1), so routes get past
    their 404 and run the model; generated token counts are capped."""
    model = _model_for(case.operation.path)
    params = case.path_parameters or {}
    if "name" in params:
        params["name"] = model
    if "version" in params:
        params["version"] = "1"
    if "model_id" in params:
        params["model_id"] = model
    if isinstance(case.body, dict):
        if "model" in case.body:
            case.body["model"] = model
        for field in TOKEN_FIELDS:
            value = case.body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
                case.body[field] = MAX_TOKENS
    return case


def _send(client: TestClient, case: Any) -> Any:
    kwargs = case.as_transport_kwargs(base_url="http://testserver")
    kwargs.pop("cookies", None)
    if "data" in kwargs:
        kwargs["content"] = kwargs.pop("data")
    return client.request(**kwargs)


def test_every_operation_answers_as_documented(
    client: TestClient, tiny_llm_dir: Path, tiny_embedder_dir: Path, tiny_reranker_dir: Path
) -> None:
    register(client, "llm", "llm", tiny_llm_dir)
    register(client, "emb", "embedder", tiny_embedder_dir)
    register(client, "rr", "reranker", tiny_reranker_dir)
    schema = schemathesis.openapi.from_dict(client.get("/openapi.json").json())
    checks = [not_a_server_error, response_schema_conformance, status_code_conformance]
    failures: dict[str, str] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.label in SKIPPED:
            continue

        @hypothesis.seed(SEED)
        @hypothesis.settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
            suppress_health_check=list(hypothesis.HealthCheck),
        )
        @hypothesis.given(case=operation.as_strategy(), steer=hypothesis.strategies.booleans())
        def check(case: Any, steer: bool) -> None:
            if steer:
                case = _steer(case)
            case.validate_response(_send(client, case), checks=checks)

        try:
            check()
        except (Exception, BaseExceptionGroup) as e:
            failures[operation.label] = str(e)[:1500]
    assert not failures, "\n\n".join(f"{k}: {v}" for k, v in failures.items())
