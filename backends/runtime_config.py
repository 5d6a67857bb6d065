"""A model version's runtime config, typed: one frozen model per kind, checked once.

A version is registered with a `config` mapping (JSON or YAML). `parse_runtime_config(kind,
raw)` turns it into the kind's model or raises `RuntimeConfigError` naming the key and why:
an unknown key (`max_batch_sizee`), a value of the wrong type (`max_documents: "many"`) or out
of range (`max_batch_size: -3`). The registry keeps the mapping exactly as registered; the
hub checks it at every edge (HTTP, CLI, config file, `Registry.register`) and hands backends
the typed object, so nothing below reads the mapping with `.get`.

- `RuntimeConfig` (every kind): where and how long the version runs (`device`, `keep_alive`,
  `pin`) and the weights' `dtype`.
- `EncoderConfig` (embedders and rerankers): dynamic batching and input length.
- `EmbedderConfig`, `RerankerConfig`, `LLMConfig`: what only that kind reads.

Keys left unset are None where the backend picks a default by device (`forward_workers`,
`unpadded`, ...), otherwise they hold the default the backend uses. This module imports
neither torch nor the hub, so the API and CLI check configs without loading a model.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from backends.units import parse_bytes, parse_keep_alive

# Strict: `"64"` is not 64 and `"yes"` is not true; a config is data, not a form to coerce.
Count = Annotated[int, Field(strict=True, ge=1)]
NonNegative = Annotated[int, Field(strict=True, ge=0)]
Flag = Annotated[bool, Field(strict=True)]
Milliseconds = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]
ByteCount = Annotated[int, BeforeValidator(parse_bytes), Field(gt=0)]
# Ollama's keep_alive: a duration ("5m", 30) of at most a year; 0 unloads after each request,
# -1 never.
KeepAlive = Annotated[float, BeforeValidator(parse_keep_alive)]

# Names accepted for `dtype` (backends.loading maps them to torch dtypes); "auto" keeps the
# checkpoint's.
DTYPE_NAMES = ("auto", "float32", "fp32", "float16", "fp16", "half", "bfloat16", "bf16")
_DEVICE_RE = re.compile(r"^(cpu|cuda:\d+)$")
_NOUNS = {"model": "a model", "embedder": "an embedder", "reranker": "a reranker", "llm": "an LLM"}


class RuntimeConfigError(ValueError):
    """A runtime config that cannot be used. `key` is the first offending key (dotted for
    nested values, e.g. `matryoshka_dims.1`), `reason` why; the message names all of them."""

    def __init__(self, message: str, *, key: str, reason: str) -> None:
        super().__init__(message)
        self.key = key
        self.reason = reason


class _KeyError(ValueError):
    """A check across keys, raised inside a model validator, blaming one key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class RuntimeConfig(BaseModel):
    """Keys every kind reads. Frozen; unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The kind this model checks, for messages ("unknown key for a reranker").
    kind: ClassVar[str] = "model"

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | RuntimeConfig | None) -> Self:
        """`raw` checked and typed; a config of this class is returned as is. Raises
        RuntimeConfigError naming the key and why."""
        if isinstance(raw, cls):
            return raw
        if isinstance(raw, RuntimeConfig):
            raise RuntimeConfigError(
                f"a {type(raw).__name__} is not the runtime config of {_NOUNS[cls.kind]}",
                key="",
                reason="wrong kind",
            )
        if raw is not None and not isinstance(raw, Mapping):
            raise RuntimeConfigError(
                f"runtime config must be a mapping of keys to values, not {type(raw).__name__}",
                key="",
                reason="not a mapping",
            )
        try:
            return cls.model_validate(dict(raw or {}))
        except ValidationError as e:
            raise _error(cls, e) from None

    # The device the version must be placed on (one of the hub's `devices`); None: placement
    # chooses. Wins over the `models:` entry of the settings.
    device: str | None = None
    # Seconds the version stays resident once idle (0: unload after each request, negative:
    # until memory pressure); None: the model entry's or the manager's default.
    keep_alive: KeepAlive | None = None
    # Pinned whenever loaded: never evicted.
    pin: Flag = False
    # Weights' dtype on the device; None or "auto": the checkpoint's.
    dtype: str | None = None

    @field_validator("device")
    @classmethod
    def _device(cls, v: str | None) -> str | None:
        if v is not None and not _DEVICE_RE.match(v):
            raise ValueError(f"{v!r} is not a device; use 'cpu' or 'cuda:N'")
        return v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str | None) -> str | None:
        if v is not None and v.lower() not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {v!r}; use one of {', '.join(DTYPE_NAMES)}")
        return v


class EncoderConfig(RuntimeConfig):
    """Batching and input length of a sentence-transformers model (embedder or reranker)."""

    # Tokens per forward pass: batch size x longest input when padded, real tokens unpadded.
    max_batch_tokens: Count = 16384
    # Inputs per forward pass.
    max_batch_size: Count = 32
    # How long an idle model waits for a batch to fill.
    batch_wait_ms: Milliseconds = 2.0
    # Inputs waiting for a forward pass; beyond it 503 + Retry-After.
    max_queue: Count = 4096
    # Longest a request may be estimated to wait for a forward pass (inputs ahead x the
    # measured seconds per input); a request that would wait longer gets 503 + Retry-After at
    # once (backends/admission.py). None: no bound, only `max_queue` (the hub's
    # `max_queue_time_ms` applies to a version that leaves the key out).
    max_queue_time_ms: Milliseconds | None = None
    # The fixed cost of one pass in padded tokens; None: by device (small on a CPU).
    batch_overhead_tokens: NonNegative | None = None
    # Forward passes in parallel and torch threads each; None: by device.
    forward_workers: Count | None = None
    worker_threads: Count | None = None
    # Lowers the model's maximum input tokens; None: the model's.
    max_seq_length: Count | None = None
    # Run batches packed into one row; None: on a CPU only.
    unpadded: Flag | None = None
    # Run forward passes in worker processes that share the weights, off the hub's
    # interpreter lock (backends/encoders/forward_process.py); None: on a CPU under `hub serve`.
    forward_process: Flag | None = None
    # The workers' niceness: 0 competes with the hub's own threads for the cores as an
    # equal, higher yields them to the event loop and the LLM engine when both want them.
    forward_process_nice: Annotated[int, Field(strict=True, ge=0, le=19)] = 10


class EmbedderConfig(EncoderConfig):
    """An embedder's runtime config."""

    kind: ClassVar[str] = "embedder"

    # `dimensions` a request may ask for (the vector is cut and renormalised).
    matryoshka_dims: Annotated[list[Count], Field(min_length=1)] | None = None
    # Whether the pipeline normalises its vectors: recorded from the model's files at
    # registration, for reading; the model's own pipeline decides.
    normalize: Flag | None = None

    @field_validator("matryoshka_dims")
    @classmethod
    def _dims(cls, v: list[int] | None) -> list[int] | None:
        return None if v is None else sorted(set(v), reverse=True)


class RerankerConfig(EncoderConfig):
    """A reranker's runtime config."""

    kind: ClassVar[str] = "reranker"

    # Documents ranked in one request at most.
    max_documents: Count = 1000


def _graphs_setting(value: object) -> object:
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(f"use true, false or 'auto' (got {value!r})")


class SpeculativeConfig(BaseModel):
    """Speculative decoding of an LLM (backends/llm/speculative): either prompt lookup
    (`method: "ngram"`, drafts copied from the sequence's own prompt and output) or a draft
    model (`draft: "name@ref"`, a registered LLM with the same tokenizer). The rest tunes
    when speculation turns itself down."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft"] | None = None
    draft: str | None = None
    # Tokens proposed per step at most.
    num_tokens: Annotated[int, Field(strict=True, ge=1, le=16)] = 4
    # Prompt lookup: the longest and shortest suffix of the sequence searched for earlier.
    min_match: Annotated[int, Field(strict=True, ge=1, le=64)] = 1
    max_match: Annotated[int, Field(strict=True, ge=1, le=64)] = 3
    # A draft model stops drafting at a token after the first that it gives less probability
    # than this (llama.cpp's p_min): such a draft is seldom accepted, and costs a draft step
    # and a verify row.
    min_draft_probability: Annotated[float, Field(strict=True, ge=0, le=1, allow_inf_nan=False)] = (
        0.2
    )
    # A sequence stops proposing once, after `min_proposed` proposed tokens, fewer than this
    # share of them were accepted.
    min_acceptance: Annotated[float, Field(strict=True, ge=0, le=1, allow_inf_nan=False)] = 0.1
    min_proposed: Count = 32
    # No speculation in a step with more decoding sequences than this (the step is then
    # bound by compute, and verifying drafts costs more than it saves).
    max_batch: Count = 16

    @model_validator(mode="after")
    def _one_source(self) -> SpeculativeConfig:
        method = self.method or ("draft" if self.draft is not None else None)
        if method is None:
            raise _KeyError("method", 'set method: "ngram" or draft: "name@ref"')
        if method == "draft" and not self.draft:
            raise _KeyError("draft", 'method "draft" needs draft: "name@ref" (a registered LLM)')
        if method == "ngram" and self.draft is not None:
            raise _KeyError("draft", 'set either method: "ngram" or a draft model, not both')
        if self.min_match > self.max_match:
            raise _KeyError("min_match", "min_match must not exceed max_match")
        return self

    @property
    def kind(self) -> Literal["ngram", "draft"]:
        """Prompt lookup or a draft model."""
        return "draft" if self.draft is not None else "ngram"


class LLMConfig(RuntimeConfig):
    """The LLM engine's runtime config (see `backends.llm.config` for each key's effect)."""

    kind: ClassVar[str] = "llm"

    # KV-cache reservation in bytes ("64MiB"), or as a share of the device budget; not both.
    kv_cache_bytes: ByteCount | None = None
    kv_cache_fraction: (
        Annotated[float, Field(strict=True, gt=0, lt=1, allow_inf_nan=False)] | None
    ) = None
    block_size: Count = 16
    max_num_seqs: Count = 64
    max_num_batched_tokens: Count = 512
    # None: the model's context length.
    max_model_len: Count | None = None
    enable_prefix_caching: Flag = True
    max_n: Count = 8
    # None: the context length.
    max_tokens_limit: Count | None = None
    default_max_tokens: Count = 256
    max_logprobs: Count = 20
    max_waiting: Count = 1024
    # Longest a new request may be estimated to wait behind the work on its device (the
    # steps its engine's sequences need at the measured step cost, plus the other models'
    # outstanding work there: backends/llm/engine_work.py); beyond it 503 +
    # Retry-After at once. None: no bound, only `max_waiting` (the hub's
    # `max_queue_time_ms` applies to a version that leaves the key out).
    max_queue_time_ms: Milliseconds | None = None
    priority_aging_steps: Count = 256
    # The model's context length, recorded from its config.json at registration, for reading.
    context_length: Count | None = None
    # Weight-only quantization applied at load (backends/llm/quantization.py, int4.py);
    # none: the model's dtype. int4 runs on the CPU only, in groups of
    # `quantization_group_size` input channels (the sizes torch's int4 kernel takes).
    quantization: Literal["none", "int8", "int4"] | None = None
    quantization_group_size: Literal[32, 64, 128, 256] = 128
    # How tool calls are found in the model's output with `tool_choice: auto`
    # (hub/api/tool_parsers); None: chosen from the chat template.
    tool_parser: Literal["hermes", "llama3_json", "mistral"] | None = None
    # LoRA adapters (backends/llm/lora): device slots for adapters used at once (more adapters
    # than that take turns, least recently used out) and the largest rank accepted.
    max_loras: Annotated[int, Field(strict=True, ge=1, le=256)] = 8
    max_lora_rank: Annotated[int, Field(strict=True, ge=1, le=512)] = 64
    # A float32 Llama-family model on the CPU runs its steps through one native call
    # (backends/llm/fused.py); false: always through the transformers modules.
    fused_step: Flag = True
    # Decode steps on a CUDA device replay a graph captured per batch-size bucket
    # (backends/llm/decode_graphs.py); "auto": on for CUDA. `cuda_graph_mode` "compile" lets
    # torch.compile(mode="reduce-overhead") make them instead of capturing them by hand.
    cuda_graphs: Annotated[bool | Literal["auto"], BeforeValidator(_graphs_setting)] = "auto"
    cuda_graph_mode: Literal["capture", "compile"] = "capture"
    # On CUDA, RMSNorm, the rotary embedding and SiLU-and-multiply of Llama-family code run as
    # one Triton kernel each (backends/llm/triton_fused.py); false: the transformers code.
    gpu_fused_ops: Flag = True
    # A decode step is launched before the previous one's tokens reach the host, so the
    # host's scheduling and output handling overlap the device (backends/llm/engine.py).
    async_steps: Flag = False
    # Structured outputs (backends/llm/structured/limits.py): the largest JSON schema, regex
    # or lark grammar, choice list (strings, and their bytes together) a request may send,
    # and how long a request waits for its grammar to compile (then 503 + Retry-After).
    max_grammar_bytes: ByteCount = 256 * 2**10
    max_choices: Count = 4096
    max_choice_bytes: ByteCount = 128 * 2**10
    grammar_compile_timeout_ms: Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)] = (
        10_000.0
    )
    # Speculative decoding (backends/llm/speculative); None: off.
    speculative: SpeculativeConfig | None = None

    def quantization_method(self) -> str | None:
        """The quantization to apply at load ("int8", "int4"), or None."""
        return None if self.quantization in (None, "none") else self.quantization

    @model_validator(mode="after")
    def _consistent(self) -> LLMConfig:
        if self.kv_cache_bytes is not None and self.kv_cache_fraction is not None:
            raise _KeyError(
                "kv_cache_fraction", "set either kv_cache_bytes or kv_cache_fraction, not both"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise _KeyError(
                "max_num_batched_tokens",
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below max_num_seqs="
                f"{self.max_num_seqs}: every running sequence needs a token per step",
            )
        return self


CONFIG_TYPES: dict[str, type[RuntimeConfig]] = {
    "embedder": EmbedderConfig,
    "reranker": RerankerConfig,
    "llm": LLMConfig,
}


def config_type(kind: str) -> type[RuntimeConfig]:
    """The runtime config model of `kind`; ValueError for a kind nothing serves."""
    try:
        return CONFIG_TYPES[str(kind)]
    except KeyError:
        known = ", ".join(CONFIG_TYPES)
        raise ValueError(f"unknown kind {kind!r}; expected one of {known}") from None


def parse_runtime_config(kind: str, raw: Mapping[str, Any] | RuntimeConfig | None) -> RuntimeConfig:
    """`raw` checked against `kind`'s model and returned typed (`EmbedderConfig`,
    `RerankerConfig` or `LLMConfig`). Raises RuntimeConfigError naming the key and why."""
    return config_type(kind).parse(raw)


def _error(cls: type[RuntimeConfig], error: ValidationError) -> RuntimeConfigError:
    problems: list[tuple[str, str]] = []
    for err in error.errors():
        key = ".".join(str(p) for p in err["loc"])
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, _KeyError):
            key = ".".join([*(str(p) for p in err["loc"]), cause.key])
        if err["type"] == "extra_forbidden":
            # A nested mapping's own keys (`speculative.foo`), else the kind's.
            nested = err["loc"][:-1] == ("speculative",)
            known = sorted((SpeculativeConfig if nested else cls).model_fields)
            close = difflib.get_close_matches(key.rsplit(".", 1)[-1], known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            reason = f"unknown key for {_NOUNS[cls.kind]} ({hint}known keys: {', '.join(known)})"
        else:
            # Errors raised by our validators read "Value error, ..."; keep the reason alone.
            reason = str(err["msg"]).removeprefix("Value error, ")
            if err["loc"] and err["type"] != "value_error":
                reason = f"{reason} (got {err['input']!r})"
        problems.append((key, reason))
    described = "; ".join(f"{k}: {r}" if k else r for k, r in problems)
    first_key, first_reason = problems[0]
    return RuntimeConfigError(
        f"invalid runtime config: {described}", key=first_key, reason=first_reason
    )
