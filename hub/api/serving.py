"""What the inference routes share besides `Serving` (hub.serving): Ollama's `keep_alive`
field, and the names routes import from one place."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator

from hub.serving import (
    EMBEDDER,
    LLM,
    RERANKER,
    VERSION_HEADER,
    InferenceRequest,
    Kind,
    Serving,
)
from hub.units import parse_keep_alive

__all__ = [
    "EMBEDDER",
    "LLM",
    "RERANKER",
    "VERSION_HEADER",
    "InferenceRequest",
    "KeepAlive",
    "Kind",
    "Serving",
]


def _keep_alive(value: Any) -> float | None:
    return None if value is None else parse_keep_alive(value)


# Ollama's keep_alive on a request: a duration ("5m", 30) of at most a year, -1 to keep
# forever, 0 to unload right after the request.
KeepAlive = Annotated[float | None, BeforeValidator(_keep_alive)]
