"""The call objects every JSON tool-call format shares: `{"name": ..., "arguments": {...}}`
(Llama 3 says `parameters`), alone or in a JSON list, read incrementally from a `Cursor`.

A call's header goes out as soon as its name is complete, and its arguments stream from
then on. Until the name is complete the object is only held: anything that shows it is not
a call (no object, a name that is not a string, no name at all) raises `NotACall`, so the
framing can hand the held text back as content.
"""

from __future__ import annotations

import json

from hub.api.tool_parsers.cursor import ArgumentsDelta, Cursor, NotACall, Scan

ARGUMENT_KEYS = ("arguments", "parameters")


def call_object(cursor: Cursor, index: int) -> Scan[None]:
    """Read one call object as call `index`. NotACall before its header went out; after
    that, an output that ends inside it or malformed arguments end the call with the
    arguments read so far (none if they had not begun)."""
    if (yield from cursor.skip_ws()) != "{":
        raise NotACall("a call is a JSON object")
    cursor.pos += 1
    named = False
    # Arguments written before the name: held until the header can go out.
    early_arguments: str | None = None
    has_arguments = False
    try:
        while True:
            c = yield from cursor.skip_ws()
            if c == "}":
                cursor.pos += 1
                break
            if c != '"':
                raise NotACall(f"expected a key, found {c!r}")
            key = json.loads((yield from cursor.string()))
            if (yield from cursor.skip_ws()) != ":":
                raise NotACall("expected ':' after a key")
            cursor.pos += 1
            c = yield from cursor.skip_ws()
            if key == "name" and not named:
                if c != '"':
                    raise NotACall("a call's name is a string")
                cursor.start_call(index, json.loads((yield from cursor.string())))
                named = True
                if early_arguments is not None:
                    cursor.events.append(ArgumentsDelta(index, early_arguments))
            elif key in ARGUMENT_KEYS and not has_arguments:
                has_arguments = True
                if named:
                    yield from cursor.arguments(index)
                else:
                    start = cursor.pos
                    yield from cursor.value()
                    raw = cursor.text[start : cursor.pos]
                    early_arguments = json.loads(raw) if raw.startswith('"') else raw
            else:
                yield from cursor.value()
            c = yield from cursor.skip_ws()
            if c == ",":
                cursor.pos += 1
            elif c != "}":
                raise NotACall(f"expected ',' or '}}', found {c!r}")
    except (NotACall, EOFError, ValueError) as e:
        if not named:
            raise NotACall("the output ended inside a call") from e
        return  # the header is out: the call stands with what was read of it
    if not named:
        raise NotACall("a call names its function")
    if not has_arguments:
        cursor.events.append(ArgumentsDelta(index, "{}"))


def call_list(cursor: Cursor, index: int) -> Scan[int]:
    """Read `[call, call, ...]` (the `[` not yet consumed) with the first call's index
    `index`; the number of calls read. NotACall if the first item is not a call; a list
    cut short, or with something else than a call after its calls, ends there."""
    cursor.pos += 1
    count = 0
    while True:
        try:
            yield from call_object(cursor, index + count)
        except NotACall:
            if count == 0:
                raise
            return count
        count += 1
        c = yield from cursor.skip_ws()
        if c == ",":
            cursor.pos += 1
            continue
        if c == "]":
            cursor.pos += 1
        return count
