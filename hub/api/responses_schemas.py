"""Request body of OpenAI's Responses API (`POST /v1/responses`), the parts a stateless
server acts on, and the mapping of its input items onto chat messages.

Accepted and ignored (the server keeps nothing): `store`, `metadata`, `user`,
`service_tier`, `truncation`, `include`, `reasoning`, `prompt_cache_key`,
`safety_identifier`, `stream_options`. Refused with a 400: `previous_response_id` and
`conversation` (they need stored responses) and `background: true`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hub.api.priority import RequestedPriority
from hub.api.serving import KeepAlive
from hub.api.structured import JsonSchemaFormat
from hub.api.tool_schemas import (
    FunctionDef,
    FunctionName,
    NamedFunction,
    NamedToolChoice,
    ToolChoice,
    ToolDef,
)
from hub.errors import BadRequest


class InputText(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(BaseModel):
    """The Responses API's flat function tool."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> ToolDef:
        return ToolDef(
            function=FunctionDef(
                name=self.name, description=self.description, parameters=self.parameters
            )
        )


class NamedResponsesTool(BaseModel):
    type: Literal["function"]
    name: FunctionName


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat | None = None
    verbosity: str | None = None


class ResponseCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedResponsesTool | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stream: bool = False
    priority: RequestedPriority = None
    keep_alive: KeepAlive = None
    # Accepted and ignored: this server is stateless.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    # Refused unless empty: they need stored state.
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None

    def check_stateless(self) -> None:
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) is not None:
                raise BadRequest(
                    f"{name} needs stored responses; this server is stateless: send the "
                    "earlier turns in input instead",
                    param=name,
                )
        if self.background:
            raise BadRequest("background responses are not supported", param="background")

    def chat_tools(self) -> list[ToolDef] | None:
        return [t.as_chat_tool() for t in self.tools] if self.tools else None

    def chat_tool_choice(self) -> ToolChoice | None:
        choice = self.tool_choice
        if isinstance(choice, NamedResponsesTool):
            return NamedToolChoice(function=NamedFunction(name=choice.name))
        return choice

    def response_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's `response_format`."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        schema = JsonSchemaFormat(name=fmt.name, schema=fmt.schema_, strict=fmt.strict)
        return {"type": "json_schema", "json_schema": schema.model_dump(by_alias=True)}

    def messages(self) -> list[dict[str, Any]]:
        """The input as chat-template messages; consecutive function calls become one
        assistant turn with several tool_calls."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            out.append({"role": "user", "content": self.input})
            return out
        for item in self.input:
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": _json_or_text(item.arguments)},
                }
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            else:
                output = item.output
                text = output if isinstance(output, str) else "".join(p.text for p in output)
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
        if not out:
            raise BadRequest("input must not be empty", param="input")
        return out


def _json_or_text(arguments: str) -> Any:
    import json

    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
