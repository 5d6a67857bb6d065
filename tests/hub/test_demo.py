"""The README's demo: `hub serve --config configs/demo.yaml` serves the real MiniLM, which the
official openai client reaches (vectors equal sentence-transformers' own `encode`), and a tiny
LLM that answers its chat completions."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.support.process import hub_process, read_log

REPO = Path(__file__).resolve().parents[2]
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the key-value cache in fixed-size blocks, like virtual memory "
    "pages, so that many sequences can share one pool without fragmentation.",
    "hi",
    "Ünïcödé and 日本語 text should embed too.",
]


@pytest.mark.slow
def test_demo_serves_minilm_to_the_openai_client(tmp_path: Path, minilm_dir: Path) -> None:
    import openai
    from sentence_transformers import SentenceTransformer

    config = REPO / "configs" / "demo.yaml"
    with hub_process(config, tmp_path) as (base, _proc):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["minilm", "tiny-llama"]
        result = client.embeddings.create(model="minilm", input=SENTENCES)
        got = np.array([d.embedding for d in result.data], dtype=np.float32)
        assert got.shape == (len(SENTENCES), 384)
        assert result.usage.prompt_tokens > len(SENTENCES)
        chat = client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8
        )
        assert chat.usage is not None and 1 <= chat.usage.completion_tokens <= 8
        log = read_log(str(next(tmp_path.glob("hub-*.log"))))
        assert f"Model Hub is serving at {base}" in log and "curl" in log

    want = SentenceTransformer(str(minilm_dir), device="cpu").encode(SENTENCES)
    cos = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.9999, cos

    # A second start reuses the registered model instead of registering it again.
    with hub_process(config, tmp_path) as (base, _):
        versions = httpx.get(f"{base}/admin/registry/models/minilm/versions").json()
        assert [v["version"] for v in versions] == [1]
        assert versions[0]["aliases"] == ["production"]
