"""The request fields that constrain output, and the one `StructuredOutput` they make.

OpenAI's `response_format` (`text`, `json_object`, `json_schema` with `strict`), vLLM's
`structured_outputs` (`json`, `regex`, `choice`, `grammar`) and its legacy `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. At most one constraint per request; a
second one is a 400 naming it. The grammar itself is compiled (and refused, if the library
cannot handle it, or if it is over the model's size limits) by the engine's compiler before
the request is queued, on the hub's grammar pool as one of the caller's compiles
(`caller_of`: backends/llm/structured/pool.py bounds what one caller holds).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request

from backends.llm.structured import StructuredOutput
from hub.api.deps import hub_of
from hub.errors import BadRequest
from hub.usage.caller import current_caller


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`. `strict` is accepted either way: output is
    always constrained to the schema."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs`: exactly one of the four."""

    model_config = ConfigDict(extra="forbid")

    json_: Annotated[dict[str, Any] | str | None, Field(alias="json")] = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class StructuredFields(BaseModel):
    """Mixed into every generation body."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The request's constraint, None for free text; BadRequest for two at once or an
        empty one."""
        found: list[tuple[str, StructuredOutput]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", StructuredOutput.json_object()))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise BadRequest(
                    "response_format json_schema needs json_schema.schema",
                    param="response_format",
                )
            found.append(("response_format", StructuredOutput.json_schema(fmt.json_schema.schema_)))
        so = self.structured_outputs
        if so is not None:
            found += _named("structured_outputs", so.json_, so.regex, so.choice, so.grammar)
        found += _named(
            "guided_*", self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar
        )
        if len(found) > 1:
            raise BadRequest(
                f"send one output constraint, not {' and '.join(f for f, _ in found)}",
                param=found[1][0],
            )
        return found[0][1] if found else None


def _named(
    field: str,
    schema: dict[str, Any] | str | None,
    regex: str | None,
    choice: list[str] | None,
    grammar: str | None,
) -> list[tuple[str, StructuredOutput]]:
    out: list[tuple[str, StructuredOutput]] = []
    if schema is not None:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise BadRequest(f"{field} json is not valid JSON: {e}", param=field) from e
        if not isinstance(schema, dict):
            raise BadRequest(f"{field} json must be a JSON schema object", param=field)
        out.append((field, StructuredOutput.json_schema(schema)))
    if regex is not None:
        out.append((field, StructuredOutput.regex(regex)))
    if choice is not None:
        if not choice or any(not c for c in choice):
            raise BadRequest(f"{field} choice needs non-empty strings", param=field)
        out.append((field, StructuredOutput.choice(choice)))
    if grammar is not None:
        out.append((field, StructuredOutput.lark(grammar)))
    return out


def caller_of(request: Request) -> str:
    """Who a request's grammar compiles count against: its API key's name (noted when
    `UserBody` checked the key), or with auth off the client's address."""
    if hub_of(request).settings.auth.enabled:
        return current_caller()
    client = request.client
    return f"client {client.host}" if client is not None else "anonymous"
