"""Which backend class serves which model kind."""

from __future__ import annotations

from backends.base import Backend, ModelKind


def backend_class(kind: ModelKind | str) -> type[Backend]:
    """The Backend subclass for `kind`; imports lazily so unused kinds cost nothing."""
    kind = ModelKind(kind)
    if kind is ModelKind.EMBEDDER:
        from backends.encoders.embedder import EmbedderBackend

        return EmbedderBackend
    if kind is ModelKind.LLM:
        from backends.llm.backend import LLMBackend

        return LLMBackend
    if kind is ModelKind.RERANKER:
        from backends.encoders.reranker import RerankerBackend

        return RerankerBackend
    raise NotImplementedError(f"no backend serves kind {kind.value!r} yet")
