"""Tool calls in chat completions: what the template sees, how output is constrained, and
how model text becomes OpenAI `tool_calls`, whole or streamed.

`tool_choice` decides the mode. `none`: the tools are not shown and text comes back. `auto`:
the chat template renders the tools and the version's parser (`tool_parsers`) finds calls in
the model's own format. `required` and a named function: output is constrained by a grammar,
so arguments always match the function's JSON schema: a named call generates the arguments
object itself, `required` a JSON list of `{"name", "arguments"}` (one item unless
`parallel_tool_calls`).

A call cut by max_tokens is still a call, in every mode and on every path, as OpenAI answers
it: `tool_calls` with the arguments generated so far (not valid JSON) and finish_reason
`length`; a finished output with calls says `tool_calls`. Streamed and whole answers are
the same by construction: `parse` is what the stream sends, assembled.

Every mode reads its output with a parser from `tool_parsers`, incrementally when streamed,
so calls stream as OpenAI sends them: a header (id, name) first, then argument fragments.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from backends.llm.sampling_params import SamplingParams
from backends.llm.structured import StructuredOutput
from hub.api.tool_parsers import (
    CallHeader,
    CallStream,
    ContentDelta,
    ParsedOutput,
    ToolParser,
    parser_for,
)
from hub.api.tool_parsers.constrained import NamedCall, RequiredCalls
from hub.api.tool_schemas import FunctionCall, NamedToolChoice, ToolCall, ToolChoice, ToolDef
from hub.errors import BadRequest

ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """One request's tool handling, decided before the prompt is built."""

    mode: ToolMode
    # What `apply_chat_template(tools=...)` receives; None: no tools in the prompt.
    template_tools: list[dict[str, Any]] | None = None
    structured: StructuredOutput | None = None
    # Reads the output: the model family's format (auto) or the constrained JSON.
    parser: ToolParser | None = None

    @property
    def active(self) -> bool:
        return self.mode != "none"


def plan_tools(
    tools: list[ToolDef] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool,
    *,
    tool_parser: str | None,
    chat_template: str | None,
) -> ToolPlan:
    """BadRequest for a choice that names no given tool, or a choice without tools."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice needs tools", param="tool_choice")
        return ToolPlan("none")
    choice = tool_choice or "auto"
    if choice == "none":
        return ToolPlan("none")
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise BadRequest(
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                param="tool_choice",
            )
        schema = StructuredOutput.json_schema(_parameters(tool))
        return ToolPlan("named", template_tools, schema, NamedCall(tool.function.name))
    if choice == "required":
        calls: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": [_call_schema(t) for t in tools]},
        }
        if not parallel_tool_calls:
            calls["maxItems"] = 1
        structured = StructuredOutput.json_schema(calls)
        return ToolPlan("required", template_tools, structured, RequiredCalls())
    return ToolPlan("auto", template_tools, parser=parser_for(tool_parser, chat_template))


def _parameters(tool: ToolDef) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _call_schema(tool: ToolDef) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.function.name},
            "arguments": _parameters(tool),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def parse_output(plan: ToolPlan, text: str, parallel_tool_calls: bool = True) -> ParsedOutput:
    """Content and calls of a finished choice's text."""
    if not plan.active or plan.parser is None:
        return ParsedOutput(text, [])
    parsed = plan.parser.parse(text)
    if not parallel_tool_calls and len(parsed.tool_calls) > 1:
        return ParsedOutput(parsed.content, parsed.tool_calls[:1])
    return parsed


@dataclass
class ToolStream:
    """Turns one choice's text deltas into chat-chunk deltas as OpenAI streams them: content
    as it comes; per call (one `index` each), a delta with its id, type and name and empty
    arguments once the name is complete, then the arguments in fragments as they are
    generated. The plan's parser decides incrementally (see hub.api.tool_parsers.cursor):
    text that may start a call is held until decided, and a false start goes out as content."""

    plan: ToolPlan
    parallel_tool_calls: bool = True
    # Ids of the calls sent so far.
    calls: list[str] = field(default_factory=list)
    _stream: CallStream | None = None

    def __post_init__(self) -> None:
        if self.plan.active and self.plan.parser is not None:
            self._stream = self.plan.parser.stream()

    def push(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """Deltas for `text`; `finished` on the choice's last delta."""
        if self._stream is None:
            return [{"content": text}] if text else []
        events = self._stream.feed(text) if text else []
        if finished:
            events += self._stream.finish()
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, ContentDelta):
                delta = {"content": event.text}
            elif event.index > 0 and not self.parallel_tool_calls:
                continue  # one call asked for: the model's others are dropped
            elif isinstance(event, CallHeader):
                self.calls.append(event.id)
                delta = _call_header(event)
            elif event.text:
                delta = _call_arguments(event.index, event.text)
            else:
                continue
            _append_merged(out, delta)
        return out


def _append_merged(out: list[dict[str, Any]], delta: dict[str, Any]) -> None:
    """Append `delta`, or fold it into the last one when both are content or fragments of
    the same call's arguments (fewer chunks, same concatenation)."""
    last = out[-1] if out else None
    if last is not None and "content" in last and "content" in delta:
        last["content"] += delta["content"]
        return
    if last is not None and "tool_calls" in last and "tool_calls" in delta:
        (a,), (b,) = last["tool_calls"], delta["tool_calls"]
        if a["index"] == b["index"] and "id" not in a and "id" not in b:
            a["function"]["arguments"] += b["function"]["arguments"]
            return
    out.append(delta)


def _call_header(header: CallHeader) -> dict[str, Any]:
    return {
        "tool_calls": [
            {
                "index": header.index,
                "id": header.id,
                "type": "function",
                "function": {"name": header.name, "arguments": ""},
            }
        ]
    }


def _call_arguments(index: int, fragment: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


def chat_tool_plan(
    tools: list[ToolDef] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool,
    backend: Any,
) -> ToolPlan:
    """`plan_tools` for a loaded LLM backend (its runtime config and chat template)."""
    return plan_tools(
        tools,
        tool_choice,
        parallel_tool_calls,
        tool_parser=backend.config.tool_parser,
        chat_template=getattr(backend.tokenizer, "chat_template", None),
    )


def apply_plan(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """The sampling parameters with the plan's constraint; BadRequest if the request
    already constrains its output another way."""
    if plan.structured is not None:
        if params.structured is not None:
            raise BadRequest(
                "a required or named tool_choice constrains the output already; drop "
                "response_format / structured_outputs or use tool_choice auto",
                param="tool_choice",
            )
        return dataclasses.replace(params, structured=plan.structured)
    if plan.parser is not None and plan.parser.name == "mistral":
        # [TOOL_CALLS] is a special token: the parser must see it.
        return dataclasses.replace(params, skip_special_tokens=False)
    return params


def message_parts(
    plan: ToolPlan, text: str, finish_reason: str | None, parallel: bool
) -> tuple[str | None, list[ToolCall] | None, str | None]:
    """(content, tool_calls, finish_reason) of a finished chat choice."""
    if not plan.active:
        return text, None, finish_reason
    parsed = parse_output(plan, text, parallel)
    if not parsed.tool_calls:
        return parsed.content, None, finish_reason
    calls = [
        ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in parsed.tool_calls
    ]
    return parsed.content, calls, "tool_calls" if finish_reason == "stop" else finish_reason
