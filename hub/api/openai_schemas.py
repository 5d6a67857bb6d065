"""Request and response bodies of the text-generation routes, OpenAI's shapes first.

`CompletionCreate` and `ChatCompletionCreate` follow OpenAI's API (plus vLLM's sampling
extensions: top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, ...);
`GenerateBody` is the per-model `/generate` body. Field constraints answer 400 naming the
field; limits that depend on the model (context length, `n`, `max_tokens`) are checked by the
engine and answer 400. `sampling_params()` turns a body into the engine's `SamplingParams`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)

from backends.llm.sampling_params import MAX_COUNT, SamplingParams
from hub.api.openai_ignored import IgnoredChatFields, StreamOptions
from hub.api.priority import RequestedPriority
from hub.api.serving import KeepAlive
from hub.api.structured import StructuredFields
from hub.api.tool_schemas import ToolCall, ToolChoice, ToolDef

TokenIds = list[Annotated[int, Field(ge=0, le=MAX_COUNT)]]


class SamplingFields(StructuredFields):
    """Sampling and stopping settings shared by every generation body (and the output
    constraints of `StructuredFields`)."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: Annotated[int, Field(ge=1, le=MAX_COUNT)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: Annotated[int, Field(ge=1, le=MAX_COUNT)] = 1
    stop: str | list[str] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extensions (vLLM's names). top_k: 0 or -1 switch it off.
    top_k: Annotated[int, Field(ge=-1, le=MAX_COUNT)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    min_tokens: Annotated[int, Field(ge=0, le=MAX_COUNT)] = 0
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # A class name or an integer level (lower runs first), never above the key's class
    # (hub/api/priority.py); None: the key's class.
    priority: RequestedPriority = None
    keep_alive: KeepAlive = None
    # False: no speculative decoding for this request, where the model has it configured.
    speculative: bool = True

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            # ASCII digits only ("²".isdigit() is true) and no longer than a token id can be.
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"logit_bias keys are token ids (ASCII digits), got {key[:20]!r}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    def sampling_params(
        self, *, max_tokens: int | None, logprobs: int | None, default_max_tokens: int | None = None
    ) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            seed=self.seed,
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            min_tokens=self.min_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured=self.structured_output(),
            speculative=self.speculative,
        )


# ---- /v1/completions ---------------------------------------------------------------------
Prompt = str | list[str] | TokenIds | list[TokenIds]


class CompletionCreate(SamplingFields):
    model: str
    prompt: Prompt
    # Log-probabilities of the sampled token and this many alternatives (OpenAI: up to 5).
    logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    # Extension: the stop string or token id that ended the choice.
    stop_reason: int | str | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Extension: prompt tokens served from the prefix cache.
    prompt_tokens_details: dict[str, int] | None = None


class CompletionPublic(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---- /v1/chat/completions ----------------------------------------------------------------
class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # ---- tool calls: an assistant turn's calls, a tool turn's answer to one ----
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # Templates know "system"; OpenAI's newer "developer" role means the same.
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [c.as_template_input() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        return message


class ChatCompletionCreate(SamplingFields, IgnoredChatFields):
    model: str
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # ---- tools (hub.api.tools) ----
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_empty_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # OpenAI leaves tool_calls out of a message that calls nothing.
        data: dict[str, Any] = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionPublic(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


# ---- /models/{name}/generate --------------------------------------------------------------
class GenerateBody(SamplingFields):
    """Exactly one of `prompt` (text), `prompt_token_ids` or `messages` (chat template)."""

    prompt: str | None = None
    prompt_token_ids: TokenIds | None = None
    messages: list[ChatMessage] | None = None
    logprobs: Annotated[int, Field(ge=0)] | None = None


class GeneratedLogprob(BaseModel):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class GeneratedChoice(BaseModel):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: int | str | None = None
    logprobs: list[GeneratedLogprob] | None = None


class GeneratePublic(BaseModel):
    id: str
    model: str
    version: int
    choices: list[GeneratedChoice]
    usage: Usage
