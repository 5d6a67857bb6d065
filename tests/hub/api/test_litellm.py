"""litellm against a live hub, as its users point it at an OpenAI- or Cohere-compatible
server: the `openai/` provider for chat (plain, streamed, tool calls required and streamed,
assembled by litellm's own `stream_chunk_builder`), the `cohere/` and `jina_ai/` providers for
rerank, and the `huggingface/` provider against TEI's `/rerank`. Answers parse into litellm's
types, tool arguments match their schemas, scores are the model's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import pytest

from hub.settings import HubSettings
from tests.hub.api.test_rerank import DOCUMENTS, QUERY, predict
from tests.hub.api.test_structured import ASK, SCHEMAS, TIME, WEATHER
from tests.support.live import live_hub
from tests.support.tool_model import serving_tool_llm


@pytest.fixture(scope="module")
def litellm() -> Any:
    # litellm fetches its model price map from GitHub at import unless told to use the copy
    # it ships: tests download nothing.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        import litellm

        yield litellm


@pytest.fixture
def base(
    settings: HubSettings,
    tiny_llm_dir: Path,
    tiny_reranker_dir: Path,
) -> Iterator[str]:
    with serving_tool_llm(settings, tiny_llm_dir) as url:
        r = httpx.post(
            f"{url}/admin/registry/models",
            json={"name": "rr", "kind": "reranker", "source": str(tiny_reranker_dir)},
            timeout=120,
        )
        assert r.status_code == 201, r.text
        yield url


def test_litellm_openai_cohere_and_jina_providers(
    litellm: Any, base: str, tiny_reranker_dir: Path
) -> None:
    openai_args = {"model": "openai/tiny", "api_base": f"{base}/v1", "api_key": "unused"}
    ask = {**openai_args, "messages": ASK, "max_tokens": 12, "temperature": 0, "timeout": 300}
    whole = litellm.completion(**ask)
    assert whole.choices[0].message.content and whole.usage.completion_tokens > 0
    chunks = list(litellm.completion(**ask, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
        whole.choices[0].message.content
    )

    tools = {**ask, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 120}
    tools["parallel_tool_calls"] = False
    called = litellm.completion(**tools)
    assert called.choices[0].finish_reason == "tool_calls"
    (call,) = called.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    # Streamed: litellm assembles the header and argument fragments into the same call.
    built = litellm.stream_chunk_builder(
        list(litellm.completion(**tools, stream=True)), messages=ASK
    )
    assert built.choices[0].finish_reason == "tool_calls"
    (streamed,) = built.choices[0].message.tool_calls
    assert streamed.function.name == call.function.name
    assert json.loads(streamed.function.arguments) == json.loads(call.function.arguments)

    want = predict(tiny_reranker_dir, QUERY, DOCUMENTS)
    order = [int(i) for i in np.argsort(-want, kind="stable")]
    for provider in ("cohere", "jina_ai"):
        answer = litellm.rerank(
            model=f"{provider}/rr",
            query=QUERY,
            documents=DOCUMENTS,
            top_n=3,
            return_documents=True,
            api_base=base,
            api_key="unused",
        )
        results = answer.results
        assert [r["index"] for r in results] == order[:3], provider
        np.testing.assert_allclose(
            [r["relevance_score"] for r in results], want[order[:3]], atol=1e-5
        )
        assert [r["document"]["text"] for r in results] == [DOCUMENTS[i] for i in order[:3]]


def test_litellm_huggingface_rerank_on_tei_shape(
    litellm: Any, settings: HubSettings, tiny_reranker_dir: Path
) -> None:
    # litellm's `huggingface/` provider speaks TEI's /rerank, with `top_n` added, and leaves
    # truncation off (so no over-long document here).
    texts = [DOCUMENTS[i] for i in (0, 1, 2, 4)]
    want = predict(tiny_reranker_dir, QUERY, texts)
    order = [int(i) for i in np.argsort(-want, kind="stable")]
    with live_hub(settings) as (base, _app):
        r = httpx.post(
            f"{base}/admin/registry/models",
            json={"name": "rr", "kind": "reranker", "source": str(tiny_reranker_dir)},
            timeout=120,
        )
        assert r.status_code == 201, r.text
        answer = litellm.rerank(
            model="huggingface/rr",
            query=QUERY,
            documents=texts,
            top_n=2,
            return_documents=True,
            api_base=base,
            api_key="unused",
        )
    assert [r["index"] for r in answer.results] == order[:2]
    np.testing.assert_allclose(
        [r["relevance_score"] for r in answer.results], want[order[:2]], atol=1e-5
    )
    assert [r["document"]["text"] for r in answer.results] == [texts[i] for i in order[:2]]
