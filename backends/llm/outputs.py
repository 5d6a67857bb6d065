"""What the engine hands back: each step's per-sequence deltas, and the error of a step that
failed."""

from __future__ import annotations

from dataclasses import dataclass

from backends.errors import TransientError
from backends.llm.sequence import FinishReason, Logprob


class EngineStepError(TransientError):
    """A step failed; the requests it ended are named. `errors` holds, per request that was
    to blame alone, its own error (the others of the step go on); when the cause could not be
    attributed, every request of the engine ended and `errors` is empty, and this error is
    what they fail with: transient (503 with Retry-After), since the engine recovers and the
    same request may well succeed when sent again."""

    def __init__(
        self,
        request_ids: list[str],
        cause: BaseException,
        errors: dict[str, BaseException] | None = None,
    ) -> None:
        super().__init__(
            f"the engine step failed ({type(cause).__name__}: {cause}); the engine recovered, "
            "send the request again"
        )
        self.request_ids = request_ids
        self.errors = errors or {}


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one sequence (sample `index`) of a request: a delta."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[Logprob]
    finish_reason: FinishReason | None
    # The stop token id or stop string that ended the sequence, if one did.
    stop_reason: int | str | None
    num_prompt_tokens: int
    # Prompt tokens whose KV came from the prefix cache.
    num_cached_tokens: int
    # Tokens generated so far by this sequence.
    num_output_tokens: int

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
