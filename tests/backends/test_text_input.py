"""Text with a lone UTF-16 surrogate is the caller's InputError naming the field, at every
backend's door, before a tokenizer (which would fail a whole batch with it) sees it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.base import BackendContext
from backends.encoders.embedder import EmbedderBackend
from backends.encoders.reranker import RerankerBackend
from backends.errors import InputError
from backends.llm.backend import LLMBackend
from backends.text_input import require_encodable


def test_require_encodable_names_the_item_and_the_character() -> None:
    require_encodable(["plain", "naïve", "😀", [1, 2]], "input")
    with pytest.raises(InputError, match=r"input\[1\].*U\+D800.*character 2") as caught:
        require_encodable(["ok", "ab\ud800"], "input")
    assert caught.value.param == "input"


async def test_each_backend_refuses_a_lone_surrogate(
    tiny_embedder_dir: Path, tiny_reranker_dir: Path, tiny_llm_dir: Path
) -> None:
    embedder = EmbedderBackend(BackendContext("e", "1", {}))
    embedder.load(tiny_embedder_dir, "cpu")
    try:
        with pytest.raises(InputError) as caught:
            await embedder.embed(["fine", "bad \udc00"])
        assert caught.value.param == "input"
        assert (await embedder.embed(["fine"])).vectors.shape[0] == 1
    finally:
        await embedder.aclose()
        embedder.unload()

    reranker = RerankerBackend(BackendContext("r", "1", {}))
    reranker.load(tiny_reranker_dir, "cpu")
    try:
        with pytest.raises(InputError) as caught:
            await reranker.rerank("query \ud800", ["doc"])
        assert caught.value.param == "query"
        with pytest.raises(InputError) as caught:
            await reranker.rerank("query", ["doc", "\udfff"])
        assert caught.value.param == "documents"
    finally:
        await reranker.aclose()
        reranker.unload()

    llm = LLMBackend(BackendContext("l", "1", {"kv_cache_bytes": 2**20}))
    llm.load(tiny_llm_dir, "cpu", torch.float32)
    try:
        with pytest.raises(InputError) as caught:
            llm.encode("x\ud83d")
        assert caught.value.param == "prompt"
        with pytest.raises(InputError) as caught:
            llm.encode_chat([{"role": "user", "content": "hi \udc00"}])
        assert caught.value.param == "messages"
        assert llm.encode("x😀")
    finally:
        await llm.aclose()
        llm.unload()
