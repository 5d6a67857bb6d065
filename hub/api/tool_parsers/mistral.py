"""Mistral style: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (v0.3 models),
or `[TOOL_CALLS]name[ARGS]{...}` repeated (newer tokenizers)."""

from __future__ import annotations

from hub.api.tool_parsers.base import ToolParser
from hub.api.tool_parsers.calls import call_list, call_object
from hub.api.tool_parsers.cursor import Cursor, NotACall, Scan

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralParser(ToolParser):
    name = "mistral"

    def scan(self, cursor: Cursor) -> Scan[None]:
        index = 0
        while (mark := (yield from cursor.content_until(MARKER))) is not None:
            try:
                c = yield from cursor.skip_ws()
                if c == "[":
                    index += yield from call_list(cursor, index)
                    continue
                if c == "{":
                    yield from call_object(cursor, index)
                else:
                    yield from _name_then_arguments(cursor, index)
                index += 1
            except NotACall:
                cursor.flush_from(mark)


def _name_then_arguments(cursor: Cursor, index: int) -> Scan[None]:
    """`name[ARGS]{...}`: the header once `[ARGS]` closes the name, then the arguments."""
    start = cursor.pos
    while not (yield from cursor.accept(ARGS)):
        c = yield from cursor.peek()
        if c is None or not (c.isalnum() or c in "_-."):
            raise NotACall("a function name is followed by [ARGS]")
        cursor.pos += 1
    name = cursor.text[start : cursor.pos - len(ARGS)]
    if not name:
        raise NotACall("[ARGS] without a function name")
    cursor.start_call(index, name)
    yield from cursor.arguments(index)
