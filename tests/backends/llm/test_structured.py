"""Structured outputs in the engine: on a tiny random-weight model, every constrained output
that finishes follows its constraint (JSON schemas checked with jsonschema), with n > 1,
sampling, seeds, prefix caching and preemption; unsupported schemas are InputErrors that
leave the engine untouched; a second request with the same schema compiles nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer

from backends.errors import InputError
from backends.llm.engine import LLMEngine
from backends.llm.sampling_params import SamplingParams
from backends.llm.sequence import FinishReason
from backends.llm.structured import StructuredOutput
from tests.backends.llm.support import build_model, kv_bytes, make_engine, run_all

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 6},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 5},
                    "zip": {"type": "integer"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "enum_const": {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "kind": {"const": "paint"},
            "ok": {"type": "boolean"},
        },
        "required": ["colour", "kind", "ok"],
        "additionalProperties": False,
    },
    "bounded_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 20},
        "minItems": 2,
        "maxItems": 4,
    },
    "any_of": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"n": {"type": "integer"}},
                "required": ["n"],
                "additionalProperties": False,
            },
            {"type": "string", "maxLength": 4},
            {"type": "null"},
        ]
    },
    "ranges_and_lengths": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "code": {"type": "string", "minLength": 3, "maxLength": 3, "pattern": "^[A-Z]+$"},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        },
        "required": ["age", "code", "tags"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("structured"), "llama")


@pytest.fixture(scope="module")
def tokenizer(llama: Path) -> Any:
    return AutoTokenizer.from_pretrained(llama)


def engine_of(llama: Path, tokenizer: Any, **config: Any) -> LLMEngine:
    return make_engine(llama, tokenizer, **config)


def prompt(tokenizer: Any, text: str = "Answer in JSON:") -> list[int]:
    return list(tokenizer.encode(text))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_finished_output_follows_its_schema(llama: Path, tokenizer: Any, name: str) -> None:
    schema = SCHEMAS[name]
    engine = engine_of(llama, tokenizer)
    spec = StructuredOutput.json_schema(schema)
    requests = [
        (prompt(tokenizer), SamplingParams(temperature=0, max_tokens=120, structured=spec)),
        (
            prompt(tokenizer, "Some data"),
            SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=120, structured=spec),
        ),
    ]
    finished = 0
    for samples in run_all(engine, requests):
        for c in samples:
            if c.finish_reason is FinishReason.STOP:
                finished += 1
                jsonschema.validate(json.loads(c.text), schema)
            else:  # cut by max_tokens: a valid prefix, usually not complete JSON
                assert c.finish_reason is FinishReason.LENGTH
    assert finished >= 1, f"no output for {name} finished within max_tokens"


def test_regex_choice_and_grammar(llama: Path, tokenizer: Any) -> None:
    engine = engine_of(llama, tokenizer)
    lark = 'start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/'
    requests = [
        (
            prompt(tokenizer),
            SamplingParams(
                temperature=0.8,
                seed=1,
                n=2,
                max_tokens=30,
                structured=StructuredOutput.regex(r"[a-c]{2,5}!"),
            ),
        ),
        (
            prompt(tokenizer),
            SamplingParams(
                temperature=1.0,
                seed=2,
                n=4,
                max_tokens=30,
                structured=StructuredOutput.choice(["yes", "no", "maybe so"]),
            ),
        ),
        (
            prompt(tokenizer),
            SamplingParams(temperature=0, max_tokens=30, structured=StructuredOutput.lark(lark)),
        ),
    ]
    regex, choice, grammar = run_all(engine, requests)
    for c in regex:
        assert c.finish_reason is FinishReason.STOP and re.fullmatch(r"[a-c]{2,5}!", c.text)
    for c in choice:
        assert c.finish_reason is FinishReason.STOP and c.text in ("yes", "no", "maybe so")
    assert re.fullmatch(r"x=[0-9]{1,3};", grammar[0].text)


def test_same_seed_same_constrained_text_under_preemption_and_prefix_caching(
    llama: Path, tokenizer: Any
) -> None:
    """A KV cache too small for the load preempts sequences (their grammar state must follow
    their tokens); the seeded results equal those of a roomy engine."""
    spec = StructuredOutput.json_schema(SCHEMAS["enum_const"])
    shared = prompt(tokenizer, "The harbour town woke slowly on winter mornings and")
    requests = [
        (
            shared + prompt(tokenizer, f" item {i}"),
            SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=40, structured=spec),
        )
        for i in range(6)
    ]
    roomy = run_all(engine_of(llama, tokenizer, block_size=4), requests)
    tight = engine_of(
        llama,
        tokenizer,
        block_size=4,
        kv_cache_bytes=kv_bytes(llama, 40, 4),
        enable_prefix_caching=True,
    )
    squeezed = run_all(tight, requests)
    assert tight.scheduler.num_preemptions > 0
    assert [[c.text for c in r] for r in squeezed] == [[c.text for c in r] for r in roomy]
    for samples in squeezed:
        for c in samples:
            if c.finish_reason is FinishReason.STOP:
                jsonschema.validate(json.loads(c.text), SCHEMAS["enum_const"])


def test_unsupported_schema_is_an_input_error_that_changes_nothing(
    llama: Path, tokenizer: Any
) -> None:
    engine = engine_of(llama, tokenizer)
    bad = StructuredOutput.json_schema({"type": "string", "format": "no-such-format"})
    with pytest.raises(InputError, match="no-such-format") as info:
        engine.add_request("bad", prompt(tokenizer), SamplingParams(structured=bad))
    assert info.value.param == "response_format"
    with pytest.raises(InputError, match="regex"):
        engine.add_request(
            "bad2", prompt(tokenizer), SamplingParams(structured=StructuredOutput.regex("(a"))
        )
    assert not engine.has_work()


def test_a_second_request_with_the_same_schema_compiles_nothing(
    llama: Path, tokenizer: Any
) -> None:
    engine = engine_of(llama, tokenizer)
    assert engine.grammars is not None
    metrics = engine.grammars.metrics
    schema = SCHEMAS["nested"]
    engine.grammars.compile(StructuredOutput.json_schema(schema))
    engine.grammars.compile(StructuredOutput.json_schema(json.loads(json.dumps(schema))))
    assert (metrics.misses, metrics.hits) == (1, 1)
