"""Tool-call parsers per model family, chosen per version.

The runtime config key `tool_parser` picks one ("hermes", "llama3_json", "mistral");
without it the chat template decides: a template that writes `<tool_call>` is Hermes/Qwen,
one with `[TOOL_CALLS]` Mistral, one with `<|python_tag|>` or an `ipython` role Llama 3.x;
anything else falls back to Hermes, the most common format of open models.

Each parser reads an output incrementally (`stream()`) or whole (`parse`), with the same
code: see `base` and `cursor`.
"""

from __future__ import annotations

from hub.api.tool_parsers.base import CallStream, ParsedOutput, ParsedToolCall, ToolParser
from hub.api.tool_parsers.cursor import ArgumentsDelta, CallHeader, ContentDelta, Event
from hub.api.tool_parsers.hermes import HermesParser
from hub.api.tool_parsers.llama3 import Llama3JsonParser
from hub.api.tool_parsers.mistral import MistralParser
from hub.errors import BadRequest

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}

__all__ = [
    "PARSERS",
    "ArgumentsDelta",
    "CallHeader",
    "CallStream",
    "ContentDelta",
    "Event",
    "ParsedOutput",
    "ParsedToolCall",
    "ToolParser",
    "parser_for",
]


def parser_for(name: str | None, chat_template: str | None) -> ToolParser:
    """The version's configured parser (runtime config `tool_parser`), else the one its chat
    template implies."""
    if name is not None:
        if name not in PARSERS:
            raise BadRequest(
                f"this model's runtime config names tool_parser={name!r}; "
                f"choose one of {', '.join(PARSERS)}",
                param="tools",
            )
        return PARSERS[name]()
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return MistralParser()
    if "<|python_tag|>" in template or "ipython" in template:
        return Llama3JsonParser()
    return HermesParser()
