"""OpenAI request fields the hub accepts and does not act on.

Clients (the openai SDK's helpers, LangChain, litellm, agent frameworks) send these as a
matter of course; refusing them breaks the client for no gain, and none of them changes what
a request means on this server. Each is listed in docs/api.md. Fields that would change the
answer and that the hub cannot honour (`audio`, `web_search_options`, `moderation`, ...) stay
unknown and are refused with a 400 naming them, as any unknown field is.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class StreamOptions(BaseModel):
    """`stream_options`: `include_usage` ends the stream with a usage event (OpenAI's default
    is false). Other keys (OpenAI's `include_obfuscation`, ...) are ignored: the hub never
    pads its events."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    include_obfuscation: bool | None = None


class IgnoredChatFields(BaseModel):
    """Chat-completion fields accepted and ignored, with why each is safe to ignore."""

    model_config = ConfigDict(extra="forbid")

    # Stateless server: nothing is stored, so nothing to tag or keep.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    # OpenAI's tiers: "flex" runs as the batch class, "priority" as interactive (within the
    # key's class, hub/api/priority.py); the others ask nothing.
    service_tier: str | None = None
    # Abuse-monitoring identifier (OpenAI's successor of `user`).
    safety_identifier: str | None = None
    # The hub caches prompt prefixes automatically, whatever the key or retention asked.
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # Predicted outputs only speed OpenAI up; the answer is the same without them.
    prediction: dict[str, Any] | None = None
    # For reasoning models; the models served here do not reason in a separate channel.
    reasoning_effort: str | None = None
    verbosity: str | None = None
    # Text is what the hub produces; asking for audio is refused (Literal names the value).
    modalities: list[Literal["text"]] | None = None
