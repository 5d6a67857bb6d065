"""Hermes / Qwen style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
number of them, after optional content."""

from __future__ import annotations

import json
import re

from hub.api.tool_parsers.base import ParsedOutput, ParsedToolCall, call_from_json, partial_marker

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesParser:
    name = "hermes"

    def start_index(self, text: str) -> int | None:
        i = text.find(START)
        return i if i >= 0 else None

    def could_start(self, text: str) -> int:
        return partial_marker(text, START)

    def parse(self, text: str) -> ParsedOutput:
        start = self.start_index(text)
        if start is None:
            return ParsedOutput(text, [])
        calls: list[ParsedToolCall] = []
        for body in _CALL.findall(text[start:]):
            try:
                call = call_from_json(json.loads(body))
            except ValueError:
                call = None
            if call is None:  # not a call after all: the whole text is content
                return ParsedOutput(text, [])
            calls.append(call)
        content = text[:start].strip()
        return ParsedOutput(content or None, calls)
