"""The one JSON reader for untrusted input: request bodies, webhooks, a source's config files.

Python's `json.loads` recurses once per nesting level, so a body of 1,000 `[` raises
RecursionError (a 500, and the worker's stack is at its limit meanwhile) and 100,000 of them
can take the process down. `loads_bounded` parses with pydantic-core's parser, which stops
at its own fixed recursion limit without touching the Python stack, and then refuses a
document nested deeper than `MAX_JSON_DEPTH` with `JsonTooDeep` (a ValueError) naming the
limit. `too_deep` answers the same question cheaply for callers that parse with pydantic
themselves.

It lives in the registry because the registry reads config files and may import neither the
hub nor the backends; the hub's request parsing uses it from here.
"""

from __future__ import annotations

from typing import Any

import pydantic_core

# Deeper than any real request or model config (OpenAI tool schemas and HF configs stay
# under ~20 levels); within pydantic-core's own limit (about 200), so its refusal is ours.
MAX_JSON_DEPTH = 128


class JsonTooDeep(ValueError):
    """A JSON document nested deeper than `MAX_JSON_DEPTH`."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what} is nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects, "
            f"the most the hub reads"
        )


def loads_bounded(raw: bytes | str, what: str = "the JSON document") -> Any:
    """The JSON value in `raw`; raises `JsonTooDeep` past `MAX_JSON_DEPTH` levels and
    ValueError for anything that is not JSON. `what` names the document in messages."""
    try:
        value = pydantic_core.from_json(raw)
    except ValueError as e:
        if "recursion limit" in str(e):
            raise JsonTooDeep(what) from None
        raise
    if depth_over(value, MAX_JSON_DEPTH):
        raise JsonTooDeep(what)
    return value


def too_deep(raw: bytes | str) -> bool:
    """Whether `raw` (JSON or not) opens more than `MAX_JSON_DEPTH` arrays and objects at
    once. Counting brackets first makes the common answer (no) cost one pass in C."""
    data = raw.encode() if isinstance(raw, str) else raw
    if data.count(b"[") + data.count(b"{") <= MAX_JSON_DEPTH:
        return False
    try:
        value = pydantic_core.from_json(data)
    except ValueError as e:
        return "recursion limit" in str(e)
    return depth_over(value, MAX_JSON_DEPTH)


def depth_over(value: Any, limit: int) -> bool:
    """Whether the parsed `value` nests arrays and objects more than `limit` deep (no
    recursion: an explicit stack of containers)."""
    if not isinstance(value, dict | list):
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False
