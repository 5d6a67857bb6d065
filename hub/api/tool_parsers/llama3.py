"""Llama 3.x JSON style: the answer is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several separated by `;`. Text that does not start with a call is content."""

from __future__ import annotations

import json

from hub.api.tool_parsers.base import ParsedOutput, ParsedToolCall, call_from_json

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser:
    name = "llama3_json"

    def start_index(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_TAG) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def could_start(self, text: str) -> int:
        # Only a leading call counts: hold back the start of the answer while it is blank
        # or a prefix of the tag.
        stripped = text.lstrip()
        if not stripped or PYTHON_TAG.startswith(stripped):
            return len(text)
        return 0

    def parse(self, text: str) -> ParsedOutput:
        start = self.start_index(text)
        if start is None:
            return ParsedOutput(text, [])
        body = text[start:].removeprefix(PYTHON_TAG).strip()
        decoder = json.JSONDecoder()
        calls: list[ParsedToolCall] = []
        pos = 0
        while pos < len(body):
            try:
                item, end = decoder.raw_decode(body, pos)
            except ValueError:
                return ParsedOutput(text, [])
            call = call_from_json(item, args_key="parameters")
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return ParsedOutput(None, calls)
