"""Kind-specific replays for shadow traffic (see hub.traffic.shadow.Replay).

Routes build one per request and hand it to `mirror_to_shadow` with the primary's output.
LLM requests are mirrored only when greedy (temperature 0), where the same model gives the
same text: `GenerationReplay` generates with the same prompts and parameters and compares by
exact match.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.base import Backend
from backends.encoders.embedder import EmbedderBackend
from hub.traffic.shadow import exact_match, mean_cosine, rank_correlation


@dataclass(frozen=True)
class EmbeddingReplay:
    """Embed the same texts; compared by mean cosine similarity of the vectors."""

    texts: Sequence[str]
    truncate: bool = True

    async def run(self, backend: Backend) -> np.ndarray:
        if not isinstance(backend, EmbedderBackend):
            raise TypeError(f"shadow backend is a {backend.kind}, not an embedder")
        result = await backend.embed(list(self.texts), truncate=self.truncate)
        return np.asarray(result.vectors)

    def compare(self, primary: Any, shadow: Any) -> float | None:
        return mean_cosine(primary, shadow)


@dataclass(frozen=True)
class RerankReplay:
    """Score the same query and documents; compared by Spearman rank correlation of the
    scores. The primary output is the list of scores in document order."""

    query: str
    documents: Sequence[str]
    truncate: bool = True
    max_tokens_per_doc: int | None = None

    async def run(self, backend: Backend) -> list[float]:
        rerank = getattr(backend, "rerank", None)
        if rerank is None:
            raise TypeError(f"shadow backend is a {backend.kind}, not a reranker")
        scored = await rerank(self.query, list(self.documents), truncate=self.truncate,
                              max_tokens_per_doc=self.max_tokens_per_doc)  # fmt: skip
        return [float(s) for s in scored.scores]

    def compare(self, primary: Any, shadow: Any) -> float | None:
        return rank_correlation(primary, shadow)


@dataclass(frozen=True)
class GenerationReplay:
    """Generate from the same prompt token ids with the same (greedy) sampling parameters;
    the output is every choice's text, compared by exact match."""

    prompts: Sequence[Sequence[int]]
    params: Any  # backends.llm.sampling_params.SamplingParams

    async def run(self, backend: Backend) -> list[str]:
        from backends.llm.backend import LLMBackend

        if not isinstance(backend, LLMBackend):
            raise TypeError(f"shadow backend is a {backend.kind}, not an llm")
        texts: list[str] = []
        for prompt in self.prompts:
            choices: dict[int, str] = {}
            async for out in backend.generate(list(prompt), self.params):
                choices[out.index] = choices.get(out.index, "") + out.text
            texts.extend(choices.get(i, "") for i in range(self.params.n))
        return texts

    def compare(self, primary: Any, shadow: Any) -> float | None:
        return exact_match(primary, shadow)
