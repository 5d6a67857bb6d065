"""Tool calls in chat completions: what the template sees, how output is constrained, and
how model text becomes OpenAI `tool_calls`, whole or streamed.

`tool_choice` decides the mode. `none`: the tools are not shown and text comes back. `auto`:
the chat template renders the tools and the version's parser (`tool_parsers`) finds calls in
the model's own format. `required` and a named function: output is constrained by a grammar,
so arguments always match the function's JSON schema: a named call generates the arguments
object itself, `required` a JSON list of `{"name", "arguments"}` (one item unless
`parallel_tool_calls`). A constrained output cut by max_tokens is not valid JSON; it comes
back as content with finish_reason `length`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from backends.llm.sampling_params import SamplingParams
from backends.llm.structured import StructuredOutput
from hub.api.tool_parsers import ParsedOutput, ParsedToolCall, ToolParser, parser_for
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
    parser: ToolParser | None = None
    named: str | None = None

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
        return ToolPlan("named", template_tools, schema, named=tool.function.name)
    if choice == "required":
        calls: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": [_call_schema(t) for t in tools]},
        }
        if not parallel_tool_calls:
            calls["maxItems"] = 1
        return ToolPlan("required", template_tools, StructuredOutput.json_schema(calls))
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
    if plan.mode == "named" and plan.named is not None:
        try:
            json.loads(text)
        except ValueError:  # cut short: hand back what there is as content
            return ParsedOutput(text, [])
        return ParsedOutput(None, [ParsedToolCall(plan.named, text)])
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return ParsedOutput(text, [])
        return ParsedOutput(
            None,
            [
                ParsedToolCall(i["name"], json.dumps(i["arguments"], ensure_ascii=False))
                for i in items
            ],
        )
    if plan.mode == "auto" and plan.parser is not None:
        parsed = plan.parser.parse(text)
        if not parallel_tool_calls and len(parsed.tool_calls) > 1:
            return ParsedOutput(parsed.content, parsed.tool_calls[:1])
        return parsed
    return ParsedOutput(text, [])


@dataclass
class ToolStream:
    """Turns one choice's text deltas into chat-chunk deltas: content as it comes, tool
    calls as OpenAI streams them (id, type and name with empty arguments first, then the
    arguments in fragments). A named call streams its arguments token by token; `required`
    and `auto` calls are sent when the output that holds them is complete."""

    plan: ToolPlan
    parallel_tool_calls: bool = True
    _text: str = ""
    _sent: int = 0  # characters of _text already sent as content (auto)
    _held: bool = False  # a call has begun (auto): nothing more goes out as content
    _named_id: str | None = None
    calls: list[ParsedToolCall] = field(default_factory=list)

    def push(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """Deltas for `text`; `finished` on the choice's last delta."""
        self._text += text
        mode = self.plan.mode
        if mode == "named" and self.plan.named is not None:
            out: list[dict[str, Any]] = []
            if self._named_id is None:
                call = ParsedToolCall(self.plan.named, "")
                self._named_id = call.id
                self.calls.append(call)
                out.append(_call_header(0, call))
            if text:
                out.append(_call_arguments(0, text))
            return out
        if mode == "auto" and self.plan.parser is not None and not self._held:
            start = self.plan.parser.start_index(self._text)
            if start is None:
                end = (
                    len(self._text)
                    if finished
                    else len(self._text) - self.plan.parser.could_start(self._text)
                )
            else:
                end, self._held = start, True
            out = []
            if end > self._sent:
                out.append({"content": self._text[self._sent : end]})
                self._sent = end
            if not (self._held and finished):
                return out
            return out + self._calls_at_end()
        if not finished:
            return []
        return self._calls_at_end()

    def _calls_at_end(self) -> list[dict[str, Any]]:
        rest = self._text[self._sent :]
        parsed = parse_output(self.plan, rest, self.parallel_tool_calls)
        self._sent = len(self._text)
        out: list[dict[str, Any]] = []
        if parsed.content:
            out.append({"content": parsed.content})
        for i, call in enumerate(parsed.tool_calls):
            self.calls.append(call)
            out.append(_call_header(i, call))
            out.append(_call_arguments(i, call.arguments))
        return out


def _call_header(index: int, call: ParsedToolCall) -> dict[str, Any]:
    return {
        "tool_calls": [
            {
                "index": index,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
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
