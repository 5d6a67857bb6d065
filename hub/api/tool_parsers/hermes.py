"""Hermes / Qwen style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
number of them, after optional content."""

from __future__ import annotations

from hub.api.tool_parsers.base import ToolParser
from hub.api.tool_parsers.calls import call_object
from hub.api.tool_parsers.cursor import Cursor, NotACall, Scan

START = "<tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def scan(self, cursor: Cursor) -> Scan[None]:
        index = 0
        # Content streams up to each `<tool_call>`; what lies between calls (the closing
        # tags, newlines) is dropped once a call went out.
        while (mark := (yield from cursor.content_until(START))) is not None:
            try:
                yield from call_object(cursor, index)
            except NotACall:
                cursor.flush_from(mark)
                continue
            index += 1
