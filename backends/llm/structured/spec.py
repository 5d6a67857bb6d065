"""What a request constrains its output to, as a hashable value; pure Python.

`StructuredOutput` is the engine-facing form of every API field that constrains output
(OpenAI's `response_format`, vLLM's `structured_outputs` and `guided_*`, a forced tool call):
a kind and its source text. `grammar()` turns it into the grammar llguidance compiles; equal
specs give equal grammars, so the compiled-grammar cache is keyed by the spec.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]

# JSON whitespace between tokens: one space, or a line break and an indent (pretty-printing
# to a depth of eight), never a free run of blanks: a weak model could spend its max_tokens
# on them, and a strong one writes nothing else.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": r"(?:[ ]|\n[ ]{0,16})?"}


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on generated text. `source`, by `kind`: a JSON schema (serialised
    compactly with its keys in their given order, since properties are generated in schema
    order), a regex, a JSON list of choice strings, or a Lark grammar."""

    kind: StructuredKind
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> StructuredOutput:
        return cls("json", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutput:
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def lark(cls, grammar: str) -> StructuredOutput:
        return cls("grammar", grammar)

    @property
    def param(self) -> str:
        """The API field a compile error is reported against."""
        return "response_format" if self.kind in ("json", "json_object") else "structured_outputs"

    def grammar(self) -> str:
        """The llguidance grammar of this constraint (not yet validated)."""
        from llguidance import LLMatcher

        if self.kind == "json":
            return LLMatcher.grammar_from_json_schema(self.source, overrides=_JSON_OPTIONS)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            options = json.loads(self.source)
            # Lark string literals take JSON's escapes, so json.dumps quotes each choice.
            return LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(o) for o in options)
            )
        return LLMatcher.grammar_from_lark(self.source)
