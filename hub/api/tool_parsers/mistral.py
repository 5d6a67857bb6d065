"""Mistral style: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (v0.3 models),
or `[TOOL_CALLS]name[ARGS]{...}` repeated (newer tokenizers)."""

from __future__ import annotations

import json

from hub.api.tool_parsers.base import (
    ParsedOutput,
    ParsedToolCall,
    call_from_json,
    partial_marker,
)

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralParser:
    name = "mistral"

    def start_index(self, text: str) -> int | None:
        i = text.find(MARKER)
        return i if i >= 0 else None

    def could_start(self, text: str) -> int:
        return partial_marker(text, MARKER)

    def parse(self, text: str) -> ParsedOutput:
        start = self.start_index(text)
        if start is None:
            return ParsedOutput(text, [])
        content = text[:start].strip() or None
        parts = [p.strip() for p in text[start:].split(MARKER) if p.strip()]
        calls: list[ParsedToolCall] = []
        for part in parts:
            if ARGS in part:
                name, _, args = part.partition(ARGS)
                calls.append(ParsedToolCall(name.strip(), args.strip()))
                continue
            try:
                items = json.JSONDecoder().raw_decode(part)[0]
            except ValueError:
                return ParsedOutput(text, [])
            for item in items if isinstance(items, list) else [items]:
                call = call_from_json(item)
                if call is None:
                    return ParsedOutput(text, [])
                calls.append(call)
        return ParsedOutput(content, calls)
