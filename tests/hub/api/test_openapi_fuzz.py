"""schemathesis over the hub's own `/openapi.json`: every operation, fed its coverage phase
(deterministic boundary and negative cases derived from the schema) and its fuzzing phase
(generated input, seed fixed) against an in-process app with the demo's three models
registered (tiny ones under the demo's names), never answers a server error and always
answers what its schema documents."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.hub.api.test_embeddings import register

schemathesis = pytest.importorskip("schemathesis")

from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.config import SchemathesisConfig  # noqa: E402
from schemathesis.generation import derive_operation_seed  # noqa: E402
from schemathesis.generation.hypothesis.builder import (  # noqa: E402
    HypothesisTestConfig,
    HypothesisTestMode,
    create_test,
)
from schemathesis.specs.openapi.checks import (  # noqa: E402
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES = 50
SEED = 16
# The demo's models (configs/demo.yaml): path parameters and `model` fields name one of them
# in most generated cases, so routes get past their 404 and run a model.
DEMO_MODELS = ("tiny-llama", "minilm", "tiny-reranker")
STEERED = 0.7
DOCUMENTED = [response_schema_conformance, status_code_conformance]

# Generation kept short so the LLM routes run many examples quickly.
MAX_TOKENS = 4
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n", "best_of")

CONFIG = {
    "seed": SEED,
    "generation": {"max-examples": EXAMPLES, "database": "none"},
    "phases": {"examples": {"enabled": True}, "coverage": {"enabled": True},
               "fuzzing": {"enabled": True}, "stateful": {"enabled": False}},
    "suppress-health-check": ["all"],
    "dictionaries": {"models": {"values": list(DEMO_MODELS)}, "versions": {"values": [1]}},
    "parameters": {
        "path.name": {"dictionary": "models", "probability": STEERED},
        "path.model_id": {"dictionary": "models", "probability": STEERED},
        "path.version": {"dictionary": "versions", "probability": STEERED},
        "body.model": {"dictionary": "models", "probability": STEERED},
    },
}  # fmt: skip

# Not fuzzed: registration copies and hashes whatever folder a generated `source` names (`/`
# would be the whole filesystem); the fixture's three registrations exercise it. One
# version's routes take the same body to the same handler as the routed ones (POST
# /models/{name}/embed ...), which are fuzzed, and resolve `{version}` as the admin
# load/unload/pin/unpin routes do, which are fuzzed too: the CI's minutes go elsewhere.
# The operations are fuzzed in PARTS tests, every PARTS-th operation in each: one test is
# then a few minutes' work at most on a loaded two-core machine, so the suite's per-test
# timeout stays a hang detector rather than a bound on the whole schema's cases.
PARTS = 3
SKIPPED = {
    "POST /admin/registry/models",
    "POST /models/{name}/versions/{version}/generate",
    "POST /models/{name}/versions/{version}/embed",
    "POST /models/{name}/versions/{version}/rerank",
}


@pytest.fixture
def fuzzed(
    client: TestClient, tiny_llm_dir: Path, tiny_embedder_dir: Path, tiny_reranker_dir: Path
) -> TestClient:
    register(client, "tiny-llama", "llm", tiny_llm_dir)
    register(client, "minilm", "embedder", tiny_embedder_dir)
    register(client, "tiny-reranker", "reranker", tiny_reranker_dir)
    return client


def _short(case: Any) -> None:
    """Cap generated token counts: the LLM's work per case stays a few tokens."""
    if not isinstance(case.body, dict):
        return
    for field in TOKEN_FIELDS:
        value = case.body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
            case.body[field] = MAX_TOKENS


def _send(client: TestClient, case: Any) -> Any:
    kwargs = case.as_transport_kwargs(base_url="http://testserver")
    kwargs.pop("cookies", None)
    if "data" in kwargs:
        kwargs["content"] = kwargs.pop("data")
    return client.request(**kwargs)


def _phases_test(operation: Any, config: Any, test: Any) -> Any:
    """`test(case)` as one Hypothesis test of `operation` running the phases `config` enables
    for it (examples, coverage, fuzzing), as `schemathesis run` does for one operation."""
    phases = config.phases_for(operation=operation)
    modes = [
        mode
        for mode, on in [
            (HypothesisTestMode.EXAMPLES, phases.examples.enabled),
            (HypothesisTestMode.COVERAGE, phases.coverage.enabled),
            (HypothesisTestMode.FUZZING, phases.fuzzing.enabled),
        ]
        if on
    ]
    settings = config.get_hypothesis_settings(
        operation=operation, phase="fuzzing", apply_ci_profile=False
    )
    return create_test(
        operation=operation,
        test_func=test,
        config=HypothesisTestConfig(
            project=config,
            modes=modes,
            settings=settings,
            apply_ci_profile=False,
            seed=derive_operation_seed(config.seed, operation.label),
        ),
    )


@pytest.mark.apart
@pytest.mark.parametrize("part", range(PARTS), ids=lambda p: f"part{p + 1}of{PARTS}")
def test_every_operation_answers_as_documented(fuzzed: TestClient, part: int) -> None:
    config = SchemathesisConfig.from_dict(CONFIG)
    schema = schemathesis.openapi.from_dict(fuzzed.get("/openapi.json").json(), config=config)
    failures: dict[str, str] = {}
    operations = [r.ok() for r in schema.get_all_operations()]
    for operation in [o for o in operations if o.label not in SKIPPED][part::PARTS]:

        def check(case: Any) -> None:
            _short(case)
            response = _send(fuzzed, case)
            # A 503 with Retry-After is the hub's documented answer when a dependency is
            # slow (its SQL on a loaded machine, say), not a server error.
            busy = response.status_code == 503 and "retry-after" in response.headers
            checks = DOCUMENTED if busy else [not_a_server_error, *DOCUMENTED]
            case.validate_response(response, checks=checks)

        try:
            _phases_test(operation, schema.config, check)()
        except (Exception, BaseExceptionGroup) as e:
            failures[operation.label] = str(e)[:1500]
    assert not failures, "\n\n".join(f"{k}: {v}" for k, v in failures.items())
