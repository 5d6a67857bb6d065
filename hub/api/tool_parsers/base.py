"""What a tool-call parser is: model text in, content and calls out, whole or as it streams.

A parser knows one way of writing tool calls (a model family's, or the JSON a constrained
`tool_choice` produces) as a `scan` over a `Cursor` (see `cursor`). `stream()` runs it on a
choice's deltas and hands out events as they are decided; `parse(text)` runs the same scan on
a finished output, so a streamed answer and a whole one are read by the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

from hub.api.tool_parsers.cursor import (
    ArgumentsDelta,
    CallHeader,
    ContentDelta,
    Cursor,
    Event,
    Scan,
)


@dataclass(frozen=True)
class ParsedToolCall:
    """One call: its id, the function's name and its arguments as a JSON text."""

    name: str
    arguments: str
    id: str


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ParsedToolCall]


class CallStream:
    """One choice's output read as it is generated: `feed` each delta, `finish` at the end;
    each returns the events decided since (content, call headers, argument fragments)."""

    def __init__(self, parser: ToolParser) -> None:
        self._cursor = Cursor()
        self._scan: Scan[None] | None = parser.scan(self._cursor)
        self._resume()  # a parser may have something to say before any text (a named call)

    def feed(self, text: str) -> list[Event]:
        self._cursor.text += text
        self._resume()
        return self._cursor.take()

    def finish(self) -> list[Event]:
        self._cursor.eof = True
        self._resume()
        return self._cursor.take()

    def _resume(self) -> None:
        if self._scan is None:
            return
        try:
            next(self._scan)
        except StopIteration:
            self._scan = None  # what comes after the parser's format is not read


class ToolParser:
    """A way of writing tool calls. Subclasses implement `scan`."""

    name: str = ""

    def scan(self, cursor: Cursor) -> Scan[None]:
        """Read the output from the cursor, emitting what it recognises."""
        raise NotImplementedError
        yield  # a generator

    def stream(self) -> CallStream:
        return CallStream(self)

    def parse(self, text: str) -> ParsedOutput:
        """Content and calls of a finished output: exactly what `stream()` sends for it,
        assembled. A call cut short (by max_tokens) or with arguments that are not JSON is
        still a call, with the arguments as generated; content is None when it is empty."""
        stream = self.stream()
        events = stream.feed(text) + stream.finish()
        headers = [e for e in events if isinstance(e, CallHeader)]
        if not headers:
            return ParsedOutput(text, [])
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        arguments = {h.index: "" for h in headers}
        for e in events:
            if isinstance(e, ArgumentsDelta):
                arguments[e.index] += e.text
        calls = [ParsedToolCall(h.name, arguments[h.index], h.id) for h in headers]
        return ParsedOutput(content or None, calls)
