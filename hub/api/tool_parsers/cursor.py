"""Reading model text as it is generated, for tool-call parsers that decide incrementally.

A parser is a generator over a `Cursor`: it reads the text from `cursor.pos` on and
suspends (`yield`) whenever it needs text that has not been generated yet; the choice's next
delta resumes it, and at the end of the output `eof` makes every read answer None instead.
What it recognises goes out as events, in order: content, a call's header (its index, id and
name) once the name is complete, then the call's arguments in fragments as they arrive.

Nothing is sent for text whose meaning is still open (a possible marker, a call object before
its name): the parser holds it, and if it turns out not to be a call (`NotACall`), the
framing hands it back as content with `flush_from`. After the first call, text outside calls
is dropped. Whitespace right before a call is not content either: trailing whitespace waits
until text or the end of the output shows it is not followed by a call.

A call whose header went out stays a call whatever follows: cut short by max_tokens or with
arguments that are not JSON, it keeps the arguments that were read, as OpenAI's answer does
for a call cut by length (its client sees finish_reason `length` and can tell).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Generator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
# A scanning step: yields (None) to wait for more text, returns its result.
Scan = Generator[None, None, T]

_WHITESPACE = " \t\r\n"
# Characters that end a JSON number or literal.
_SCALAR_END = ",}]; \t\r\n"


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallHeader:
    """A call begins: OpenAI's first delta of a call, with `arguments: ""`."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


Event = ContentDelta | CallHeader | ArgumentsDelta


class NotACall(Exception):
    """What looked like the start of a call is not one (raised before its header went out)."""


def partial_marker(text: str, marker: str, start: int = 0) -> int:
    """Length of the longest suffix of `text[start:]` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class Cursor:
    """The text of one choice so far, the parser's position in it and the events it has
    produced."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.eof = False
        self.events: list[Event] = []
        self.calls = 0
        # The call whose arguments are being read: (index, where the unsent part starts).
        self._open_args: tuple[int, int] | None = None

    # ---- reading -------------------------------------------------------------------------
    def peek(self) -> Scan[str | None]:
        """The next character, waiting for it; None at the end of the output."""
        while self.pos >= len(self.text):
            if self.eof:
                return None
            self._send_arguments()  # what arrived of the arguments goes out before waiting
            yield
        return self.text[self.pos]

    def skip_ws(self, also: str = "") -> Scan[str | None]:
        """Skip whitespace (and the characters in `also`); the next character after it."""
        while True:
            c = yield from self.peek()
            if c is None or (c not in _WHITESPACE and c not in also):
                return c
            self.pos += 1

    def accept(self, literal: str) -> Scan[bool]:
        """Consume `literal` if the text continues with it, waiting until that is decided."""
        while True:
            ahead = self.text[self.pos : self.pos + len(literal)]
            if ahead == literal:
                self.pos += len(literal)
                return True
            if not literal.startswith(ahead) or self.eof:
                return False
            yield

    def content_until(self, marker: str) -> Scan[int | None]:
        """Send text as content up to `marker`, consume the marker and return where the text
        held for it begins (the marker and the whitespace before it, which `flush_from` hands
        back if no call follows); or send it all up to the end of the output (None). A tail
        that may begin the marker waits, and so does trailing whitespace."""
        while True:
            at = self.text.find(marker, self.pos)
            if at >= 0:
                held = _blank_tail(self.text, self.pos, at)
                self.emit_content(self.text[self.pos : held])
                self.pos = at + len(marker)
                return held
            end = len(self.text)
            if not self.eof:
                end -= partial_marker(self.text, marker, self.pos)
                end = _blank_tail(self.text, self.pos, end)
            self.emit_content(self.text[self.pos : end])
            self.pos = end
            if self.eof:
                return None
            yield

    def rest_as_content(self) -> Scan[None]:
        while (yield from self.peek()) is not None:
            self.emit_content(self.text[self.pos :])
            self.pos = len(self.text)

    def string(self) -> Scan[str]:
        """A JSON string's raw text (quotes included); EOFError if the output ends in it."""
        start = self.pos
        self.pos += 1  # the opening quote
        escaped = False
        while True:
            c = yield from self.peek()
            if c is None:
                raise EOFError
            self.pos += 1
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                return self.text[start : self.pos]

    def value(self) -> Scan[None]:
        """Read one JSON value's extent (its text is `text[start:pos]` afterwards). Strings
        and nesting are followed, not validated; EOFError if the output ends inside it,
        NotACall if it cannot begin a value."""
        c = yield from self.peek()
        if c is None:
            raise EOFError
        if c == '"':
            yield from self.string()
            return
        if c not in "{[":
            if not (c.isdigit() or c in "-tfn"):
                raise NotACall(f"no JSON value starts with {c!r}")
            while (c := (yield from self.peek())) is not None and c not in _SCALAR_END:
                self.pos += 1
            return
        depth = 0
        while True:
            c = yield from self.peek()
            if c is None:
                raise EOFError
            if c == '"':  # brackets inside strings do not count
                yield from self.string()
                continue
            self.pos += 1
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return

    # ---- events --------------------------------------------------------------------------
    def emit_content(self, text: str) -> None:
        if text and not self.calls:
            self.events.append(ContentDelta(text))

    def flush_from(self, mark: int) -> None:
        """A false start: the text held since `mark` is content after all (after a call,
        dropped like all text outside calls)."""
        self.emit_content(self.text[mark : self.pos])

    def start_call(self, index: int, name: str) -> None:
        self.calls += 1
        self.events.append(CallHeader(index, f"call_{uuid.uuid4().hex[:24]}", name))

    def arguments(self, index: int) -> Scan[None]:
        """Read a call's arguments value, sending it in fragments as it arrives; an output
        that ends inside it, or text that is no JSON value, ends it where it stands. Arguments
        written as a JSON string (some models do) go out decoded, once complete."""
        c = yield from self.skip_ws()
        start = self.pos
        if c == '"':
            try:
                decoded = json.loads((yield from self.string()))
            except (EOFError, ValueError):
                return
            self.events.append(ArgumentsDelta(index, decoded))
            return
        self._open_args = (index, start)
        try:
            yield from self.value()
        except (EOFError, NotACall):
            pass
        finally:
            self._send_arguments()
            self._open_args = None

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    def _send_arguments(self) -> None:
        if self._open_args is None:
            return
        index, sent = self._open_args
        if self.pos > sent:
            self.events.append(ArgumentsDelta(index, self.text[sent : self.pos]))
            self._open_args = (index, self.pos)


def _blank_tail(text: str, start: int, end: int) -> int:
    """Where the whitespace that ends `text[start:end]` begins."""
    while end > start and text[end - 1] in _WHITESPACE:
        end -= 1
    return end
