"""How large a constraint a model compiles, and for how long: checked before any compile.

Compiling grows with the grammar: a list of 200,000 choices or a lark grammar of a few
megabytes keeps a thread busy for minutes and takes gigabytes, and llguidance's own symbol
limit fires only after most of that work. `GrammarLimits.check` refuses such a constraint at
once (InputError: a 400 naming the limit and the runtime-config key that sets it), from the
source's size alone; `compile_timeout_s` bounds how long a request waits for its compile.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from backends.errors import InputError
from backends.llm.structured.spec import StructuredOutput

DEFAULT_MAX_GRAMMAR_BYTES = 256 * 2**10
DEFAULT_MAX_CHOICES = 4096
DEFAULT_MAX_CHOICE_BYTES = 128 * 2**10
DEFAULT_COMPILE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class GrammarLimits:
    """One model's limits (its runtime config: `max_grammar_bytes`, `max_choices`,
    `max_choice_bytes`, `grammar_compile_timeout_ms`)."""

    # Bytes of a JSON schema (compact), regex or lark grammar, UTF-8.
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
    # Strings in a choice list, and their UTF-8 bytes together.
    max_choices: int = DEFAULT_MAX_CHOICES
    max_choice_bytes: int = DEFAULT_MAX_CHOICE_BYTES
    # Longest a request waits for its grammar (queued and compiling) before a 503.
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S

    @classmethod
    def of(cls, config: Any) -> GrammarLimits:
        """The limits an `LLMConfig` sets (defaults for what it leaves out)."""
        timeout_ms = getattr(config, "grammar_compile_timeout_ms", None)
        return cls(
            max_grammar_bytes=getattr(config, "max_grammar_bytes", DEFAULT_MAX_GRAMMAR_BYTES),
            max_choices=getattr(config, "max_choices", DEFAULT_MAX_CHOICES),
            max_choice_bytes=getattr(config, "max_choice_bytes", DEFAULT_MAX_CHOICE_BYTES),
            compile_timeout_s=(
                DEFAULT_COMPILE_TIMEOUT_S if timeout_ms is None else timeout_ms / 1000
            ),
        )

    def check(self, spec: StructuredOutput) -> None:
        """InputError naming the limit when `spec` is over one; cheap (no compile)."""
        if spec.kind == "choice":
            self._check_choices(spec)
            return
        size = len(spec.source.encode())
        if size > self.max_grammar_bytes:
            raise InputError(
                f"this {_WHAT[spec.kind]} is {size} bytes, over this model's limit of "
                f"{self.max_grammar_bytes} bytes (runtime config max_grammar_bytes); "
                "send a smaller one",
                param=spec.param,
            )

    def _check_choices(self, spec: StructuredOutput) -> None:
        # The source is the JSON list: each string's escaped form takes at most six
        # characters per UTF-8 byte, plus quotes and a separator, so a longer source is over
        # a limit without being parsed.
        bound = 6 * self.max_choice_bytes + 4 * self.max_choices + 2
        if len(spec.source) > bound:
            raise InputError(
                f"the choice list is {len(spec.source)} characters of JSON, over what this "
                f"model's limits allow: {self.max_choices} choices of {self.max_choice_bytes} "
                "bytes together (runtime config max_choices, max_choice_bytes)",
                param=spec.param,
            )
        options: list[str] = json.loads(spec.source)
        if len(options) > self.max_choices:
            raise InputError(
                f"the choice list has {len(options)} choices, over this model's limit of "
                f"{self.max_choices} (runtime config max_choices)",
                param=spec.param,
            )
        size = sum(len(o.encode()) for o in options)
        if size > self.max_choice_bytes:
            raise InputError(
                f"the choice list holds {size} bytes, over this model's limit of "
                f"{self.max_choice_bytes} bytes (runtime config max_choice_bytes)",
                param=spec.param,
            )


_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object constraint",
    "regex": "regex",
    "grammar": "grammar",
}
