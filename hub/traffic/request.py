"""What the traffic layer records of one request while `serve()` serves it.

`TrafficService.begin` creates a `ServedRequest`; the route reaches it through the request
handle `serve()` yields (hub.api.serving), never through a global:

    req.report_tokens(result.total_tokens)                 # embeddings: input tokens;
                                                           # LLM: generated tokens
    req.mirror_to_shadow(EmbeddingReplay(texts, truncate), result.vectors)

`mirror_to_shadow` hands over the primary's output and how to replay the request on another
version; it is kept only when the traffic policy selected this request for its shadow, and
the mirror is queued only after the primary's answer is complete (`TrafficService.finish`).
Once finished, the record ignores further reports.
"""

from __future__ import annotations

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

    @property
    def mirrored(self) -> bool:
        """Whether this request will be mirrored to a shadow version (routes whose replay is
        costly to prepare check this first)."""
        return self.shadow is not None and not self.finished

    def report_tokens(self, tokens: int) -> None:
        """Add `tokens` to the count (for tokens per second in readouts)."""
        if not self.finished:
            self.tokens += int(tokens)

    def mirror_to_shadow(self, replay: Replay, output: Any) -> None:
        """Offer the primary's `output` and how to `replay` the request on the shadow."""
        if self.mirrored:
            self.replay, self.output = replay, output
