"""Compiled grammars, cached by constraint, and the per-sequence matchers made from them.

One `GrammarCompiler` belongs to one engine, so one tokenizer: the cache key is the
`StructuredOutput` and the tokenizer is implied. Compiling (building llguidance's lexer and
parser for a grammar) takes from well under a millisecond to, for a large schema, a good part
of a second; the backend runs `compile` on a `CompilePool` thread (pool.py), within the
model's `GrammarLimits` (limits.py), before the request reaches the engine; `matcher` then
only copies the cached, never-advanced matcher (microseconds).
A grammar llguidance cannot compile raises `InputError` naming what it does not support;
nothing is cached for it and nothing reaches the engine.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from backends.errors import InputError
from backends.llm.structured.metrics import GrammarMetrics
from backends.llm.structured.spec import StructuredOutput

# Compiled grammars kept per engine; the least recently used goes first.
DEFAULT_CACHE_SIZE = 256


class GrammarCompiler:
    """Thread-safe: `compile` and `matcher` may run in any thread at once."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        metrics: GrammarMetrics | None = None,
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self.metrics = metrics or GrammarMetrics(None, "", "")
        self._cache_size = cache_size
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None

    @property
    def ll_tokenizer(self) -> Any:
        """llguidance's view of the tokenizer, built on first use (about a second for a large
        vocabulary). Every stop token of the model ends a grammar, not only the tokenizer's
        eos, and ids past the tokenizer's vocabulary (padded heads) are never allowed."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer,
                        n_vocab=self._vocab_size,
                        eos_token=self._eos_token_ids or None,
                    )
                except Exception as e:
                    raise InputError(
                        f"structured outputs are unavailable for this model: its tokenizer "
                        f"cannot be used for constrained decoding ({e})",
                        param="response_format",
                    ) from e
            return self._ll_tokenizer

    def cached(self, spec: StructuredOutput) -> bool:
        """Whether `spec` is compiled already (counted as a hit): then `matcher` needs no
        compile and the request need not wait for a compile thread."""
        with self._lock:
            found = spec in self._cache
            if found:
                self._cache.move_to_end(spec)
        if found:
            self.metrics.observe_hit()
        return found

    def compile(self, spec: StructuredOutput, *, count_hit: bool = True) -> Any:
        """The pristine matcher of `spec`, compiled now or taken from the cache."""
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
        if cached is not None:
            if count_hit:
                self.metrics.observe_hit()
            return cached
        from llguidance import LLMatcher

        tokenizer = self.ll_tokenizer
        start = time.perf_counter()
        try:
            grammar = spec.grammar()
        except (ValueError, TypeError) as e:
            raise InputError(f"invalid {spec.kind} constraint: {e}", param=spec.param) from e
        # Both run without the GIL, so a worker thread compiling does not stall the loop.
        error = LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InputError(_unsupported(spec, error), param=spec.param)
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InputError(_unsupported(spec, matcher.get_error()), param=spec.param)
        self.metrics.observe_compile(time.perf_counter() - start)
        with self._lock:
            self._cache[spec] = matcher
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh matcher for one sequence (its own state, the shared compiled grammar).
        A hit here is not counted: the request was counted when the hub compiled ahead."""
        return self.compile(spec, count_hit=False).deep_copy()


def _unsupported(spec: StructuredOutput, error: str) -> str:
    what = {
        "json": "JSON schema",
        "json_object": "JSON object constraint",
        "regex": "regex",
        "choice": "choice list",
        "grammar": "grammar",
    }[spec.kind]
    return f"this {what} cannot be used for structured output: {error.strip()}"
