"""A live hub serving a tiny random-weight LLM for tool-call tests. The tiny tokenizer's chat
template (backends.tiny.tokenizer) shows tools, calls and tool results the Hermes / Qwen 2.5
way, so any tiny LLM runs a tool loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx

from hub.settings import HubSettings
from tests.support.live import live_hub


@contextlib.contextmanager
def serving_tool_llm(settings: HubSettings, model_dir: Path) -> Iterator[str]:
    """A live hub (a real socket, for the SDKs) with the LLM in `model_dir` registered as
    `tiny`; yields its base URL."""
    with live_hub(settings) as (url, _app):
        r = httpx.post(
            f"{url}/admin/registry/models",
            json={"name": "tiny", "kind": "llm", "source": str(model_dir)},
            timeout=120,
        )
        assert r.status_code == 201, r.text
        yield url
