"""The formats a grammar makes the model write for `tool_choice` `required` and a named
function (hub.api.tools): the same incremental reading as the model families' parsers, so
those calls stream their arguments as they are generated too."""

from __future__ import annotations

from hub.api.tool_parsers.base import ToolParser
from hub.api.tool_parsers.calls import call_list
from hub.api.tool_parsers.cursor import Cursor, NotACall, Scan


class RequiredCalls(ToolParser):
    """`[{"name": ..., "arguments": {...}}, ...]`, one item or more."""

    name = "required"

    def scan(self, cursor: Cursor) -> Scan[None]:
        if (yield from cursor.skip_ws()) == "[":
            try:
                yield from call_list(cursor, 0)
                return
            except NotACall:  # only a cut-short output gets here: it is content
                pass
        cursor.flush_from(0)
        yield from cursor.rest_as_content()


class NamedCall(ToolParser):
    """The arguments object of one function, known before anything is generated."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def scan(self, cursor: Cursor) -> Scan[None]:
        cursor.start_call(0, self.function)
        yield from cursor.arguments(0)
