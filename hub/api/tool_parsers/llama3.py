"""Llama 3.x JSON style: the answer is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several separated by `;`. Text that does not start with a call is content."""

from __future__ import annotations

from hub.api.tool_parsers.base import ToolParser
from hub.api.tool_parsers.calls import call_object
from hub.api.tool_parsers.cursor import Cursor, NotACall, Scan

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def scan(self, cursor: Cursor) -> Scan[None]:
        # Only a leading call counts: the answer's start is held while it is blank or a
        # prefix of the tag.
        c = yield from cursor.skip_ws()
        if (yield from cursor.accept(PYTHON_TAG)):
            c = yield from cursor.skip_ws()
        index = 0
        try:
            while c == "{":
                yield from call_object(cursor, index)
                index += 1
                c = yield from cursor.skip_ws(also=";")
        except NotACall:
            pass
        if index == 0:  # no call after all: the whole answer is content
            cursor.flush_from(0)
            yield from cursor.rest_as_content()
