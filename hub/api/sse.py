"""Server-sent events of a streamed generation: each event's bytes, and the response that
sends them.

A streamed token costs the event loop its chunk's JSON, once per token of every stream, on
the cores the engine's step runs on. `ChunkTemplate` renders the common chunk (one choice's
new text, nothing else changing) from pre-rendered pieces with only the index and the text
filled in, byte for byte what `event` makes of the same object.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from hub.api.errors import error_body
from hub.api.generation import Generation
from hub.api.serving import VERSION_HEADER

# What `json.dumps(..., ensure_ascii=False)` does to a string (the C encoder it calls).
_encode_str = json.encoder.encode_basestring

# Stand-ins for the varying fields while a template is rendered: private-use characters,
# which a model name or request id does not contain (a template checks it).
INDEX = "\ue000index\ue001"
TEXT = "\ue000text\ue001"

DONE = b"data: [DONE]\n\n"


def event(data: dict[str, Any]) -> bytes:
    """One `data:` event holding `data` as JSON (non-ASCII characters as they are)."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


class ChunkTemplate:
    """The bytes of events that differ only in a choice index and a text. Built from an
    event's object holding `INDEX` and `TEXT` where those go (each once, as a value);
    `render(i, t)` equals `event(obj)` with the stand-ins replaced by `i` and `t`."""

    __slots__ = ("_after", "_before_index", "_before_text")

    def __init__(self, data: dict[str, Any]) -> None:
        rendered = event(data).decode()
        before_index, index, rest = rendered.partition(_encode_str(INDEX))
        before_text, text, after = rest.partition(_encode_str(TEXT))
        if not (index and text) or INDEX[0] in before_index + before_text + after:
            raise ValueError("a template holds INDEX, then TEXT, each once")
        self._before_index = before_index
        self._before_text = before_text
        self._after = after

    def render(self, index: int, text: str) -> bytes:
        return (
            f"{self._before_index}{index}{self._before_text}{_encode_str(text)}{self._after}"
        ).encode()


def sse_response(gen: Generation, events: AsyncIterator[str | bytes]) -> StreamingResponse:
    """Stream `events`, then `data: [DONE]`; on the way out (done, failed or the client
    gone) abort what is unfinished and release the model."""

    async def body() -> AsyncIterator[str | bytes]:
        try:
            async for chunk in events:
                yield chunk
        except Exception as e:  # the engine failed mid-stream: tell the client, then stop
            await gen.close(type(e), e, e.__traceback__)
            yield event(error_body(str(e), "server_error"))
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away mid-stream: recorded as such (499), not as a success.
            gone = asyncio.CancelledError()
            await asyncio.shield(gen.close(asyncio.CancelledError, gone, None))
            raise
        finally:
            # Shielded: a client that went away cancels this task, and the model must still
            # be released (its blocks are freed synchronously, first thing in `close`).
            await asyncio.shield(gen.close())
        yield DONE

    headers = {VERSION_HEADER: gen.route.label, "Cache-Control": "no-cache"}
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
