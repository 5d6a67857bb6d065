"""What a request asks of the sampler and of stopping, validated before it reaches the engine.

`SamplingParams.validate` raises `InputError` naming the offending field, so a bad value is
the caller's 400 and never touches the engine's state. Limits that depend on the model (vocab
size, context length, configured maxima) are checked by the engine on `add_request`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from backends.errors import InputError
from backends.llm.structured.spec import StructuredOutput

# Below this a temperature means greedy decoding (argmax), as in OpenAI's API.
GREEDY_EPSILON = 1e-5
# Counts and token ids become int64 tensors in the sampler; anything near that range means
# nothing (no vocabulary or context is that large) and would overflow there, failing the
# whole step. Counts are capped well below it; a seed fits a torch generator's 64 bits.
MAX_COUNT = 2**31 - 1
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling and stopping settings (OpenAI's, plus vLLM's extensions)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Same seed, same text, whatever else shares the batch (a generator per sequence).
    seed: int | None = None
    # None: the engine's default, capped by the room left in the context.
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    # None: no log-probabilities; k: the sampled token's plus the k most likely ones.
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # A grammar the output must follow (JSON schema, regex, choice, Lark); None: free text.
    structured: StructuredOutput | None = None
    # False: never speculate for this request, even where the model is configured to.
    speculative: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to record or change but the argmax: no log-probabilities,
        bias or penalties (a sequence adds its grammar and min_tokens ban). Cached: the
        samplers ask it of every row of every step."""
        return (
            self.greedy
            and self.logprobs is None
            and not self.logit_bias
            and not self.needs_penalties
        )

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self) -> None:
        """Raise InputError naming the first field out of its range."""
        for name in ("n", "top_k", "min_tokens"):
            _check_int(name, getattr(self, name))
        for name in ("max_tokens", "logprobs", "seed"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), MAX_SEED if name == "seed" else MAX_COUNT)
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _check(
                isinstance(value, int | float) and math.isfinite(value),
                name,
                f"{name} must be a finite number, got {value!r}",
            )
        _check(self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        _check(
            math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0,
            "temperature",
            f"temperature must be in [0, 2], got {self.temperature}",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"top_k must be 0 (off) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
            "repetition_penalty",
            f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2], got {value}")
        for token, bias in self.logit_bias.items():
            _check_int("logit_bias", token)
            _check(token >= 0, "logit_bias", f"logit_bias token id {token} is negative")
            _check(
                isinstance(bias, int | float) and math.isfinite(bias) and -100.0 <= bias <= 100.0,
                "logit_bias",
                f"logit_bias for token {token} must be in [-100, 100], got {bias}",
            )
        if self.max_tokens is not None:
            _check(
                self.max_tokens >= 1, "max_tokens", f"max_tokens must be >= 1: {self.max_tokens}"
            )
        _check(self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0: {self.min_tokens}")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})",
            )
        _check(all(self.stop), "stop", "stop strings must not be empty")
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token)
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "token ids are >= 0")
        if self.logprobs is not None:
            _check(self.logprobs >= 0, "logprobs", f"logprobs must be >= 0: {self.logprobs}")
        if self.seed is not None:
            _check(
                0 <= self.seed <= MAX_SEED, "seed", f"seed must be in [0, 2**63), got {self.seed}"
            )


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def _check_int(param: str, value: object, limit: int = MAX_COUNT) -> None:
    """`value` is an int (not a bool) of magnitude at most `limit`."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InputError(f"{param} must be an integer, got {value!r}", param=param)
    if not -limit <= value <= limit:
        # str() of a huge int is slow (and refused past 4300 digits): name its size instead.
        shown = str(value) if value.bit_length() <= 100 else f"a {value.bit_length()}-bit number"
        raise InputError(
            f"{param}={shown} is out of range (at most {limit} in magnitude)", param=param
        )


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InputError(message, param=param)
