"""The demo: `hub serve --config configs/demo.yaml` serves the real MiniLM, which the
official openai client reaches (vectors of sentences of mixed lengths sent concurrently equal
sentence-transformers' own `encode`), a tiny LLM that answers its chat completions and a tiny
reranker that answers /v1/rerank. (That a second start reuses what the first registered is
tests/hub/api/test_admin_models.py's, on an in-process hub.)"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from benchmarks.launch.process import hub_process

REPO = Path(__file__).resolve().parents[2]
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the key-value cache in fixed-size blocks, like virtual memory "
    "pages, so that many sequences can share one pool without fragmentation.",
    "hi",
    "Ünïcödé and 日本語 text should embed too.",
]


@pytest.mark.slow
@pytest.mark.apart
def test_demo_serves_minilm_to_the_openai_client(tmp_path: Path, minilm_dir: Path) -> None:
    import openai
    from sentence_transformers import SentenceTransformer

    config = REPO / "configs" / "demo.yaml"
    # Every sentence also as one request of its own, all at once, plus longer mixes.
    singles = SENTENCES + [" ".join(SENTENCES[: i % 4 + 1]) * (i % 3 + 1) for i in range(12)]
    # What the answers are is tested here, not shedding: the demo's bound on the estimated
    # wait (max_queue_time_ms) could refuse part of the concurrent requests on a busy runner.
    env = {"HUB_MAX_QUEUE_TIME_MS": "60000"}
    with hub_process(config, tmp_path, env=env) as (base, _proc):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        names = [m.id for m in client.models.list().data]
        assert names == ["minilm", "tiny-llama", "tiny-reranker"]
        # The whole log: readiness polls during a slow start push the banner out of its tail.
        log = next(tmp_path.glob("hub-*.log")).read_text()
        assert f"Model Hub is serving at {base}" in log and "curl" in log
        # Ready once the preloads were attempted, and by then the start-up heap is frozen.
        assert "start-up objects out of the garbage collector's way" in log
        result = client.embeddings.create(model="minilm", input=SENTENCES)
        got = np.array([d.embedding for d in result.data], dtype=np.float32)
        assert got.shape == (len(SENTENCES), 384)
        assert result.usage.prompt_tokens > len(SENTENCES)
        chat = client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8
        )
        assert chat.usage is not None and 1 <= chat.usage.completion_tokens <= 8
        with ThreadPoolExecutor(len(singles)) as pool:
            answers = list(
                pool.map(lambda s: client.embeddings.create(model="minilm", input=s), singles)
            )
        each = np.array([a.data[0].embedding for a in answers], dtype=np.float32)
        reranked = httpx.post(
            f"{base}/v1/rerank",
            json={"model": "tiny-reranker", "query": "a fox", "documents": SENTENCES,
                  "top_n": 2, "return_documents": True},
            timeout=60,
        )  # fmt: skip
        assert reranked.status_code == 200, reranked.text
        top = reranked.json()["results"]
        assert len(top) == 2 and top[0]["relevance_score"] >= top[1]["relevance_score"]
        assert top[0]["document"]["text"] == SENTENCES[top[0]["index"]]
        # The encoders' passes ran in worker processes of their own (hub serve's default on
        # a CPU), the LLM's in the hub's.
        rows = {r["name"]: r for r in httpx.get(f"{base}/admin/models", timeout=30).json()}
        assert rows["tiny-llama"]["worker_pids"] == []
        for name in ("minilm", "tiny-reranker"):
            pids = rows[name]["worker_pids"]
            assert pids and _proc.pid not in pids, rows[name]
            assert all(Path(f"/proc/{pid}").exists() for pid in pids)

    model = SentenceTransformer(str(minilm_dir), device="cpu")
    for vectors, texts in [(got, SENTENCES), (each, singles)]:
        want = model.encode(texts)
        norms = np.linalg.norm(vectors, axis=1) * np.linalg.norm(want, axis=1)
        cos = np.sum(vectors * want, axis=1) / norms
        assert cos.min() >= 0.9999, cos
