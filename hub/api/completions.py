"""Text generation: OpenAI's `/v1/completions` and `/v1/chat/completions`, and the per-model
`/models/{name}/generate` routes, each with `stream: true` as server-sent events.

A streamed response holds the model (the manager's `acquire`) until its last event is sent or
the client goes away; either way the engine request is aborted if unfinished, which frees its
KV blocks at once. Every response, streamed too, names its version in `X-Hub-Model-Version`.
Streams end with `data: [DONE]`; with `stream_options: {include_usage: true}` a usage event
(choices empty) comes just before it, and every other event carries `usage: null`, as OpenAI's
do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from backends.llm.backend import LLMBackend
from backends.llm.sampling_params import SamplingParams
from backends.llm.sequence import Logprob
from hub.api.bodies import UserBody, openapi_body, route_key_of
from hub.api.deps import router_of, serving_of
from hub.api.generation import Choice, Generation, start_generation
from hub.api.openai_ignored import StreamOptions
from hub.api.openai_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionCreate,
    ChatCompletionPublic,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionCreate,
    CompletionLogprobs,
    CompletionPublic,
    GenerateBody,
    GeneratedChoice,
    GeneratedLogprob,
    GeneratePublic,
    Prompt,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from hub.api.priority import request_level
from hub.api.serving import VERSION_HEADER, Serving
from hub.api.sse import INDEX, TEXT, ChunkTemplate, event, sse_response
from hub.api.tools import ToolPlan, ToolStream, apply_plan, chat_tool_plan, message_parts
from hub.errors import BadRequest
from hub.routing import Route

# Bodies are read and the caller authenticated by UserBody (hub/api/bodies.py).
router = APIRouter(tags=["generation"])

# OpenAI's default for the legacy completions endpoint.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


# ---- /v1/completions ---------------------------------------------------------------------
@router.post("/v1/completions", response_model=CompletionPublic,
             openapi_extra=openapi_body(CompletionCreate, route_key=True))  # fmt: skip
async def create_completion(
    body: Annotated[CompletionCreate, UserBody(CompletionCreate)],
    request: Request,
    response: Response,
) -> CompletionPublic | StreamingResponse:
    route = router_of(request).route(body.model, route_key=route_key_of(request) or body.user)
    serving = serving_of(request)
    if body.suffix:
        raise BadRequest("suffix (fill-in-the-middle) is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise BadRequest("best_of other than n is not supported", param="best_of")
    if body.echo and body.logprobs is not None:
        raise BadRequest(
            "echo with logprobs (prompt log-probabilities) is not supported", param="echo"
        )

    def build(backend: LLMBackend) -> tuple[list[list[int]], SamplingParams]:
        params = body.sampling_params(
            max_tokens=body.max_tokens,
            logprobs=body.logprobs,
            default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
        )
        return _encode_prompts(body.prompt, backend), params

    gen = await start_generation(
        serving, route, "completions", build, keep_alive=body.keep_alive, request=request,
        priority=request_level(request, body.priority),
    )  # fmt: skip
    if body.stream:
        return sse_response(gen, _completion_events(gen, body))
    choices = await gen.answer(request)
    response.headers[VERSION_HEADER] = route.label
    return CompletionPublic(
        id=f"cmpl-{gen.id}",
        created=gen.created,
        model=route.name,
        choices=[
            CompletionChoice(
                index=c.index,
                text=(echo := _echo(gen, c.index, body.echo)) + c.text,
                logprobs=_completion_logprobs(gen.backend, c.logprobs, start=len(echo))
                if body.logprobs is not None
                else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in choices
        ],
        usage=_usage(gen),
    )


def _encode_prompts(prompt: Prompt, backend: LLMBackend) -> list[list[int]]:
    if isinstance(prompt, str):
        return [backend.encode(prompt)]
    if not prompt:
        raise BadRequest("prompt must not be an empty list", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [backend.encode(p) for p in prompt]  # type: ignore[arg-type]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return [list(p) for p in prompt]  # type: ignore[arg-type]


def _echo(gen: Generation, index: int, echo: bool) -> str:
    return gen.backend.decode(gen.prompts[index // gen.params.n]) if echo else ""


async def _completion_events(gen: Generation, body: CompletionCreate) -> AsyncIterator[bytes]:
    head: dict[str, Any] = {
        "id": f"cmpl-{gen.id}",
        "object": "text_completion",
        "created": gen.created,
        "model": gen.route.name,
    }
    include_usage = _include_usage(body.stream_options)
    if include_usage:
        head["usage"] = None
    # A chunk of new text only, as most are: rendered from a template.
    fields = {"index": INDEX, "text": TEXT, "logprobs": None, "finish_reason": None}
    plain = ChunkTemplate({**head, "choices": [{**fields, "stop_reason": None}]})
    # Per choice: the text_offset of its next token (the echoed prompt counts).
    offsets: dict[int, int] = {}
    async for index, out in gen.deltas():
        text = out.text
        if index in offsets and body.logprobs is None and out.finish_reason is None:
            if text:  # else held back for a possible stop string
                yield plain.render(index, text)
            continue
        if index not in offsets:
            echo = _echo(gen, index, body.echo)
            offsets[index] = len(echo)
            text = echo + text
        logprobs = None
        if body.logprobs is not None:
            lp = _completion_logprobs(gen.backend, out.logprobs, start=offsets[index])
            offsets[index] += sum(len(t) for t in lp.tokens)
            logprobs = lp.model_dump()
        finish = out.finish_reason.value if out.finish_reason else None
        if not text and finish is None and logprobs is None:
            continue  # held back for a possible stop string
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": out.stop_reason,
        }
        yield event({**head, "choices": [choice]})
    if include_usage:
        yield event({**head, "choices": [], "usage": _usage(gen).model_dump()})


def _completion_logprobs(
    backend: LLMBackend, logprobs: list[Logprob], *, start: int
) -> CompletionLogprobs:
    """OpenAI's legacy logprobs; `text_offset` is each token's character offset in the
    returned text (after an echoed prompt), the lengths of the tokens before it added to
    `start`, as vLLM computes it."""
    result = CompletionLogprobs()
    offset = start
    for lp in logprobs:
        token = backend.decode([lp.token_id])
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
        result.token_logprobs.append(lp.logprob)
        result.top_logprobs.append({backend.decode([t]): v for t, v in lp.top})
    return result


# ---- /v1/chat/completions ----------------------------------------------------------------
@router.post("/v1/chat/completions", response_model=ChatCompletionPublic,
             openapi_extra=openapi_body(ChatCompletionCreate, route_key=True))  # fmt: skip
async def create_chat_completion(
    body: Annotated[ChatCompletionCreate, UserBody(ChatCompletionCreate)],
    request: Request,
    response: Response,
) -> ChatCompletionPublic | StreamingResponse:
    route = router_of(request).route(body.model, route_key=route_key_of(request) or body.user)
    serving = serving_of(request)
    if body.top_logprobs is not None and not body.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    plans: list[ToolPlan] = []  # decided in build, where the backend is known

    def build(backend: LLMBackend) -> tuple[list[list[int]], SamplingParams]:
        plan = chat_tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, backend)
        plans.append(plan)
        messages = [m.as_template_input() for m in body.messages]
        prompt = backend.encode_chat(messages, tools=plan.template_tools)
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = body.sampling_params(max_tokens=max_tokens, logprobs=logprobs)
        return [prompt], apply_plan(params, plan)

    gen = await start_generation(
        serving, route, "chat", build, keep_alive=body.keep_alive, prompt_param="messages",
        request=request, priority=request_level(request, body.priority, body.service_tier),
    )  # fmt: skip
    plan, parallel = plans[0], body.parallel_tool_calls
    if body.stream:
        return sse_response(
            gen, _chat_events(gen, logprobs is not None, body.stream_options, plan, parallel)
        )
    choices = await gen.answer(request)
    response.headers[VERSION_HEADER] = route.label
    answers = [message_parts(plan, c.text, c.finish_reason, parallel) for c in choices]
    return ChatCompletionPublic(
        id=f"chatcmpl-{gen.id}",
        created=gen.created,
        model=route.name,
        choices=[
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content=content, tool_calls=calls),
                logprobs=_chat_logprobs(gen.backend, c.logprobs) if logprobs is not None else None,
                finish_reason=finish,
                stop_reason=c.stop_reason,
            )
            for c, (content, calls, finish) in zip(choices, answers, strict=True)
        ],
        usage=_usage(gen),
    )


async def _chat_events(
    gen: Generation,
    with_logprobs: bool,
    stream_options: StreamOptions | None,
    plan: ToolPlan | None = None,
    parallel: bool = True,
) -> AsyncIterator[bytes]:
    head: dict[str, Any] = {
        "id": f"chatcmpl-{gen.id}",
        "object": "chat.completion.chunk",
        "created": gen.created,
        "model": gen.route.name,
    }
    include_usage = _include_usage(stream_options)
    if include_usage:
        head["usage"] = None
    # A chunk of new content only, as most are: rendered from a template.
    content = {"index": INDEX, "delta": {"content": TEXT}, "finish_reason": None}
    plain = ChunkTemplate({**head, "choices": [{**content, "logprobs": None}]})
    tools_active = plan is not None and plan.active
    started: set[int] = set()
    tool_streams: dict[int, ToolStream] = {}
    async for index, out in gen.deltas():
        if index in started and not (tools_active or with_logprobs) and out.finish_reason is None:
            if out.text:
                yield plain.render(index, out.text)
            continue
        delta: dict[str, Any] = {}
        if index not in started:
            started.add(index)
            delta["role"] = "assistant"
        finish = out.finish_reason.value if out.finish_reason else None
        if plan is not None and tools_active:
            # Tool calls: content and call deltas as the ToolStream releases them, one chunk
            # each; the finishing chunk names tool_calls if any call went out.
            tools = tool_streams.setdefault(index, ToolStream(plan, parallel))
            for part in tools.push(out.text, finish is not None):
                chunk = {"index": index, "delta": {**delta, **part}, "finish_reason": None}
                delta = {}
                yield event({**head, "choices": [{**chunk, "logprobs": None}]})
            if finish == "stop" and tools.calls:
                finish = "tool_calls"
        elif out.text:
            delta["content"] = out.text
        if not delta and finish is None and not with_logprobs:
            continue
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "finish_reason": finish,
            "logprobs": None,
        }
        if with_logprobs:
            choice["logprobs"] = _chat_logprobs(gen.backend, out.logprobs).model_dump()
        yield event({**head, "choices": [choice]})
    if include_usage:
        yield event({**head, "choices": [], "usage": _usage(gen).model_dump()})


def _chat_logprobs(backend: LLMBackend, logprobs: list[Logprob]) -> ChoiceLogprobs:
    def top(token_id: int, value: float) -> TopLogprob:
        # `bytes` are the token's own, so a character split over byte tokens joins back.
        text = backend.decode([token_id])
        return TopLogprob(token=text, logprob=value, bytes=list(backend.token_bytes(token_id)))

    return ChoiceLogprobs(
        content=[
            TokenLogprob(
                **top(lp.token_id, lp.logprob).model_dump(),
                top_logprobs=[top(t, v) for t, v in lp.top],
            )
            for lp in logprobs
        ]
    )


# ---- /models/{name}/generate -------------------------------------------------------------
@router.post("/models/{name}/generate", response_model=GeneratePublic,
             openapi_extra=openapi_body(GenerateBody, route_key=True))  # fmt: skip
async def generate_routed(
    name: str,
    body: Annotated[GenerateBody, UserBody(GenerateBody)],
    request: Request,
    response: Response,
) -> GeneratePublic | StreamingResponse:
    route = router_of(request).route(name, route_key=route_key_of(request) or body.user)
    return await _generate(serving_of(request), route, body, request, response)


@router.post("/models/{name}/versions/{version}/generate", response_model=GeneratePublic,
             openapi_extra=openapi_body(GenerateBody))  # fmt: skip
async def generate_version(
    name: str,
    version: str,
    body: Annotated[GenerateBody, UserBody(GenerateBody)],
    request: Request,
    response: Response,
) -> GeneratePublic | StreamingResponse:
    route = router_of(request).route_version(name, version)
    return await _generate(serving_of(request), route, body, request, response)


async def _generate(
    serving: Serving, route: Route, body: GenerateBody, request: Request, response: Response
) -> GeneratePublic | StreamingResponse:
    given = [f for f in ("prompt", "prompt_token_ids", "messages") if getattr(body, f) is not None]
    if len(given) != 1:
        raise BadRequest(
            "send exactly one of prompt, prompt_token_ids or messages",
            param=given[-1] if given else "prompt",
        )

    def build(backend: LLMBackend) -> tuple[list[list[int]], SamplingParams]:
        if body.prompt is not None:
            prompt = backend.encode(body.prompt)
        elif body.prompt_token_ids is not None:
            prompt = list(body.prompt_token_ids)
        else:
            prompt = backend.encode_chat([m.as_template_input() for m in body.messages or []])
        return [prompt], body.sampling_params(max_tokens=body.max_tokens, logprobs=body.logprobs)

    gen = await start_generation(
        serving, route, "generate", build, keep_alive=body.keep_alive, prompt_param=given[0],
        request=request, priority=request_level(request, body.priority),
    )  # fmt: skip
    if body.stream:
        return sse_response(gen, _generate_events(gen))
    choices = await gen.answer(request)
    response.headers[VERSION_HEADER] = route.label
    return GeneratePublic(
        id=gen.id,
        model=route.name,
        version=route.version,
        choices=[_generated(c) for c in choices],
        usage=_usage(gen),
    )


def _generated(c: Choice) -> GeneratedChoice:
    return GeneratedChoice(
        index=c.index,
        text=c.text,
        token_ids=c.token_ids,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        logprobs=[
            GeneratedLogprob(token_id=lp.token_id, logprob=lp.logprob, top=list(lp.top))
            for lp in c.logprobs
        ]
        or None,
    )


async def _generate_events(gen: Generation) -> AsyncIterator[bytes]:
    async for index, out in gen.deltas():
        choice = Choice(index)
        choice.add(out)
        yield event(_generated(choice).model_dump())
    yield event({"usage": _usage(gen).model_dump()})


# ---- shared ------------------------------------------------------------------------------
def _include_usage(options: StreamOptions | None) -> bool:
    """OpenAI sends the usage event only when asked: a client looping over
    `chunk.choices[0]` would fail on its empty `choices`."""
    return options is not None and options.include_usage


def _usage(gen: Generation) -> Usage:
    return Usage(
        prompt_tokens=gen.prompt_tokens,
        completion_tokens=gen.completion_tokens,
        total_tokens=gen.prompt_tokens + gen.completion_tokens,
        prompt_tokens_details={"cached_tokens": gen.cached_tokens},
    )
