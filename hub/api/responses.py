"""OpenAI's Responses API, `POST /v1/responses`, stateless: the whole conversation comes in
`input` each time (`store` is accepted and ignored; `previous_response_id` is refused).

A request becomes a chat generation: `instructions` and the input items become chat
messages, function tools and `tool_choice` follow the chat route's tool handling
(`hub.api.tools`), `text.format` becomes the output constraint. The answer's `output` holds a
`message` item with the text and a `function_call` item per call. With `stream: true` the
events are OpenAI's typed ones: response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta, ...done,
response.function_call_arguments.delta / .done, response.output_item.done, response.completed.

An answer cut by max_output_tokens is `incomplete`, and so is its last item (the message or
the function call it was writing, with what was generated of it), streamed or not; the
items before it are `completed`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response

from backends.llm.backend import LLMBackend
from backends.llm.sampling_params import SamplingParams
from hub.api.bodies import UserBody, openapi_body, route_key_of
from hub.api.completions import sse_response
from hub.api.deps import router_of, serving_of
from hub.api.generation import Generation, start_generation
from hub.api.priority import request_level
from hub.api.responses_schemas import ResponseCreate
from hub.api.serving import VERSION_HEADER
from hub.api.structured import ResponseFormat, StructuredFields
from hub.api.tools import ToolPlan, ToolStream, apply_plan, chat_tool_plan, parse_output

router = APIRouter(tags=["generation"])


@router.post("/v1/responses", openapi_extra=openapi_body(ResponseCreate, route_key=True))
async def create_response(
    body: Annotated[ResponseCreate, UserBody(ResponseCreate)],
    request: Request,
    response: Response,
) -> Any:
    body.check_stateless()
    route = router_of(request).route(body.model, route_key=route_key_of(request) or body.user)
    serving = serving_of(request)
    fmt = body.response_format()
    structured = StructuredFields(
        response_format=ResponseFormat.model_validate(fmt) if fmt else None
    ).structured_output()
    plans: list[ToolPlan] = []

    def build(backend: LLMBackend) -> tuple[list[list[int]], SamplingParams]:
        tools, choice = body.chat_tools(), body.chat_tool_choice()
        plan = chat_tool_plan(tools, choice, body.parallel_tool_calls, backend)
        plans.append(plan)
        prompt = backend.encode_chat(body.messages(), tools=plan.template_tools)
        params = SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            max_tokens=body.max_output_tokens,
            structured=structured,
        )
        return [prompt], apply_plan(params, plan)

    gen = await start_generation(
        serving, route, "responses", build, keep_alive=body.keep_alive, prompt_param="input",
        request=request, priority=request_level(request, body.priority, body.service_tier),
    )  # fmt: skip
    shell = _Shell(body, gen)
    if body.stream:
        return sse_response(gen, _events(gen, shell, plans[0]))
    (choice,) = await gen.answer(request)
    response.headers[VERSION_HEADER] = route.label
    parsed = parse_output(plans[0], choice.text, body.parallel_tool_calls)
    output: list[dict[str, Any]] = []
    if parsed.content is not None or not parsed.tool_calls:
        output.append(_message_item(shell.new_id("msg"), parsed.content or "", "completed"))
    for call in parsed.tool_calls:
        output.append(
            _call_item(shell.new_id("fc"), call.id, call.name, call.arguments, "completed")
        )
    output[-1]["status"] = _last_item_status(choice.finish_reason)
    return shell.snapshot(output, choice.finish_reason)


def _last_item_status(finish_reason: str | None) -> str:
    """The status of an answer's last item: cut by max_output_tokens, it is incomplete."""
    return "incomplete" if finish_reason == "length" else "completed"


class _Shell:
    """The response object around the output: ids, the request's settings, usage."""

    def __init__(self, body: ResponseCreate, gen: Generation) -> None:
        self.body = body
        self.gen = gen
        self.id = f"resp_{gen.id}"
        self.created_at = int(time.time())
        self.sequence = 0

    def new_id(self, prefix: str) -> str:
        return f"{prefix}_{uuid.uuid4().hex}"

    def snapshot(
        self, output: list[dict[str, Any]], finish_reason: str | None, *, done: bool = True
    ) -> dict[str, Any]:
        body = self.body
        incomplete = done and finish_reason == "length"
        status = "in_progress" if not done else "incomplete" if incomplete else "completed"
        tool_choice = body.tool_choice or "auto"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.gen.route.name,
            "output": output,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": tool_choice
            if isinstance(tool_choice, str)
            else tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "text": {"format": _format_of(body)},
            "store": False,
            "metadata": body.metadata or {},
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": self.usage() if done else None,
        }

    def usage(self) -> dict[str, Any]:
        gen = self.gen
        return {
            "input_tokens": gen.prompt_tokens,
            "input_tokens_details": {"cached_tokens": gen.cached_tokens},
            "output_tokens": gen.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        }

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _format_of(body: ResponseCreate) -> dict[str, Any]:
    fmt = body.text.format if body.text is not None else None
    if fmt is None:
        return {"type": "text"}
    return fmt.model_dump(by_alias=True, exclude_none=True)


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [] if status == "in_progress" else content,
    }


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


async def _events(gen: Generation, shell: _Shell, plan: ToolPlan) -> AsyncIterator[str]:
    """OpenAI's typed stream: one message item for text, one function_call item per call."""
    yield shell.event("response.created", response=shell.snapshot([], None, done=False))
    yield shell.event("response.in_progress", response=shell.snapshot([], None, done=False))
    output: list[dict[str, Any]] = []
    message: dict[str, Any] | None = None  # the open message item: id, index, text
    call: dict[str, Any] | None = None  # the open function_call item
    tools = ToolStream(plan, shell.body.parallel_tool_calls) if plan.active else None
    finish: str | None = None

    def close_message(status: str = "completed") -> list[str]:
        nonlocal message
        if message is None:
            return []
        m, message = message, None
        part = {"type": "output_text", "text": m["text"], "annotations": [], "logprobs": []}
        where = {"item_id": m["id"], "output_index": m["index"], "content_index": 0}
        item = _message_item(m["id"], m["text"], status)
        output.append(item)
        return [
            shell.event("response.output_text.done", **where, text=m["text"], logprobs=[]),
            shell.event("response.content_part.done", **where, part=part),
            shell.event("response.output_item.done", output_index=m["index"], item=item),
        ]

    def close_call(status: str = "completed") -> list[str]:
        nonlocal call
        if call is None:
            return []
        c, call = call, None
        item = _call_item(c["id"], c["call_id"], c["name"], c["arguments"], status)
        output.append(item)
        where = {"item_id": c["id"], "output_index": c["index"]}
        return [
            shell.event(
                "response.function_call_arguments.done",
                **where,
                arguments=c["arguments"],
                name=c["name"],
            ),
            shell.event("response.output_item.done", output_index=c["index"], item=item),
        ]

    def text(delta: str) -> list[str]:
        nonlocal message
        events = close_call()
        if message is None:
            message = {"id": shell.new_id("msg"), "index": len(output), "text": ""}
            where = {"item_id": message["id"], "output_index": message["index"]}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(
                shell.event(
                    "response.output_item.added",
                    output_index=message["index"],
                    item=_message_item(message["id"], "", "in_progress"),
                )
            )
            events.append(
                shell.event("response.content_part.added", **where, content_index=0, part=part)
            )
        if delta:
            message["text"] += delta
            events.append(
                shell.event(
                    "response.output_text.delta",
                    item_id=message["id"],
                    output_index=message["index"],
                    content_index=0,
                    delta=delta,
                    logprobs=[],
                )
            )
        return events

    def tool_delta(part: dict[str, Any]) -> list[str]:
        nonlocal call
        (entry,) = part["tool_calls"]
        events: list[str] = []
        if "id" in entry:  # a new call: its header
            events += close_message() + close_call()
            call = {
                "id": shell.new_id("fc"),
                "index": len(output),
                "call_id": entry["id"],
                "name": entry["function"]["name"],
                "arguments": "",
            }
            item = _call_item(call["id"], call["call_id"], call["name"], "", "in_progress")
            events.append(
                shell.event("response.output_item.added", output_index=call["index"], item=item)
            )
            return events
        assert call is not None
        fragment = entry["function"]["arguments"]
        call["arguments"] += fragment
        events.append(
            shell.event(
                "response.function_call_arguments.delta",
                item_id=call["id"],
                output_index=call["index"],
                delta=fragment,
            )
        )
        return events

    async for _, out in gen.deltas():
        finished = out.finish_reason is not None
        if finished:
            finish = out.finish_reason.value if out.finish_reason else None
        parts = tools.push(out.text, finished) if tools is not None else [{"content": out.text}]
        for part in parts:
            events = tool_delta(part) if "tool_calls" in part else text(part.get("content", ""))
            for event in events:
                yield event
    if not output and message is None and call is None:
        for event in text(""):
            yield event
    # At most one item is still open: the last, cut short if the answer was.
    last = _last_item_status(finish)
    for event in close_message(last) + close_call(last):
        yield event
    kind = "response.incomplete" if finish == "length" else "response.completed"
    yield shell.event(kind, response=shell.snapshot(output, finish))
