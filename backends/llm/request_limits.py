"""What one generation request may ask of an engine: checked before anything is queued.

Pure: a request's prompt and sampling parameters against the model's limits, raising
`InputError` naming the field (`ContextLengthError` when they overflow the context), or the
number of tokens the request may generate.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.errors import ContextLengthError, InputError
from backends.llm.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """One engine's limits, as its config and model resolve them."""

    vocab_size: int
    max_model_len: int
    # The largest `max_tokens` accepted (at most max_model_len).
    max_tokens_limit: int
    max_n: int
    max_logprobs: int
    # What a request without `max_tokens` may generate (also bounded by the context left).
    default_max_tokens: int


def checked_max_tokens(
    prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits
) -> int:
    """Raise InputError for a request these limits refuse; return its max_tokens."""
    params.validate()
    n_prompt = len(prompt_token_ids)
    if n_prompt == 0:
        raise InputError("the prompt is empty; send at least one token", param="prompt")
    vocab = limits.vocab_size
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
    if bad:
        raise InputError(f"prompt token ids {bad[:5]} are outside [0, {vocab})", param="prompt")
    if params.n > limits.max_n:
        raise InputError(f"n={params.n} exceeds this model's limit of {limits.max_n}", param="n")
    if params.logprobs is not None and params.logprobs > limits.max_logprobs:
        raise InputError(
            f"logprobs={params.logprobs} exceeds this model's limit of {limits.max_logprobs}",
            param="logprobs",
        )
    for token in (*params.logit_bias, *params.stop_token_ids):
        if token >= vocab:
            param = "logit_bias" if token in params.logit_bias else "stop_token_ids"
            raise InputError(
                f"token id {token} is outside the vocabulary [0, {vocab})", param=param
            )
    room = limits.max_model_len - n_prompt
    if room < 1:
        raise ContextLengthError(
            f"the prompt has {n_prompt} tokens but this model's context is "
            f"{limits.max_model_len} tokens, leaving no room to generate",
            param="prompt",
        )
    if params.max_tokens is None:
        max_tokens = min(limits.default_max_tokens, room, limits.max_tokens_limit)
        if params.min_tokens > max_tokens:
            raise InputError(
                f"min_tokens={params.min_tokens} exceeds the {max_tokens} tokens this "
                "request may generate; lower it or set max_tokens",
                param="min_tokens",
            )
        return max_tokens
    if params.max_tokens > limits.max_tokens_limit:
        raise InputError(
            f"max_tokens={params.max_tokens} exceeds this model's limit of "
            f"{limits.max_tokens_limit}",
            param="max_tokens",
        )
    if params.max_tokens > room:
        raise ContextLengthError(
            f"this model's context is {limits.max_model_len} tokens, but the request needs "
            f"{n_prompt + params.max_tokens} ({n_prompt} in the prompt plus max_tokens="
            f"{params.max_tokens}); shorten the prompt or lower max_tokens",
            param="max_tokens",
        )
    return params.max_tokens
