"""What a tool-call parser is: model text in, content and calls out.

A parser knows one model family's way of writing tool calls. `parse` splits a finished
output into the text meant for the user and the calls; `start_marker` is the text that opens
the first call, so a stream can send content up to it and hold the rest back.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ParsedToolCall:
    """One call: the function's name and its arguments as a JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ParsedToolCall]


class ToolParser(Protocol):
    name: str

    def start_index(self, text: str) -> int | None:
        """Where the first tool call begins in `text`, None if none has begun."""
        ...

    def could_start(self, text: str) -> int:
        """How many trailing characters of `text` might be the beginning of a call marker
        (held back while streaming)."""
        ...

    def parse(self, text: str) -> ParsedOutput: ...


def call_from_json(item: Any, *, args_key: str = "arguments") -> ParsedToolCall | None:
    """A call from `{"name": ..., "arguments"|"parameters": {...}}`; None if not one."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    args = item.get(args_key, item.get("parameters", item.get("arguments", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        return ParsedToolCall(item["name"], args)
    return ParsedToolCall(item["name"], json.dumps(args, ensure_ascii=False))


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
