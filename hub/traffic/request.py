"""The request-scoped handle `serve()` opens for every inference request.

Routes report what only they know through two one-liners, valid inside `async with serve(...)`
(outside it they do nothing):

    report_tokens(result.total_tokens)                     # embeddings: input tokens;
                                                           # LLM: generated tokens
    mirror_to_shadow(EmbeddingReplay(texts, truncate), result.vectors)

`mirror_to_shadow` hands over the primary's output and how to replay the request on another
version; it is used only when the traffic policy selected this request for its shadow, and
the mirror is queued only after the primary's answer is complete (when `serve()` exits).
The handle lives in a context variable, so nothing changes in `serve()`'s signature.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from hub.routing import Route
from hub.traffic.shadow import Replay
from registry.views import ShadowView


@dataclass
class ServedRequest:
    """What is known about one request while it is served; touched only on the event loop."""

    route: Route
    # The shadow version this request is mirrored to, if the policy selected it.
    shadow: ShadowView | None = None
    tokens: int = 0
    replay: Replay | None = None
    output: Any = None
    finished: bool = False


_current: ContextVar[ServedRequest | None] = ContextVar("hub_served_request", default=None)


def current_request() -> ServedRequest | None:
    """The request `serve()` is serving in this context, if any."""
    request = _current.get()
    return request if request is not None and not request.finished else None


def report_tokens(tokens: int) -> None:
    """Add `tokens` to the current request's count (for tokens per second in readouts)."""
    request = current_request()
    if request is not None:
        request.tokens += int(tokens)


def shadow_selected() -> bool:
    """Whether the current request will be mirrored, for routes whose replay is costly to
    prepare; `mirror_to_shadow` checks this itself."""
    request = current_request()
    return request is not None and request.shadow is not None


def mirror_to_shadow(replay: Replay, output: Any) -> None:
    """Offer the primary's `output` and how to `replay` the request on the shadow version."""
    request = current_request()
    if request is not None and request.shadow is not None:
        request.replay, request.output = replay, output


def enter(request: ServedRequest) -> None:
    _current.set(request)


def leave(request: ServedRequest) -> None:
    request.finished = True
    # A streaming route may leave serve() in another context than it entered it; resetting
    # by token would fail there, and the finished flag already makes the handle inert.
    with contextlib.suppress(ValueError, LookupError):
        if _current.get() is request:
            _current.set(None)
