"""OpenAI's tool shapes in chat requests and answers (function tools only)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# A function's name as OpenAI accepts it; checked at the edge wherever a request names one.
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]


class FunctionDef(BaseModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    # A JSON text, as OpenAI sends it.
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_template_input(self) -> dict[str, Any]:
        """Chat templates expect the arguments as an object (they `tojson` them)."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": arguments},
        }
