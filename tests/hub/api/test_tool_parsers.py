"""Tool-call parsers per model family, their choice from the runtime config or the chat
template, and the streaming of parsed calls in OpenAI's delta shape."""

from __future__ import annotations

import json

import pytest

from hub.api.tool_parsers import parser_for
from hub.api.tool_parsers.hermes import HermesParser
from hub.api.tool_parsers.llama3 import Llama3JsonParser
from hub.api.tool_parsers.mistral import MistralParser
from hub.api.tools import ToolPlan, ToolStream
from hub.errors import BadRequest


def calls(parsed: object) -> list[tuple[str, dict[str, object]]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]  # type: ignore[attr-defined]


def test_hermes_calls_after_content() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call>'
    )
    parsed = HermesParser().parse(text)
    assert parsed.content == "Let me check."
    assert calls(parsed) == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": 1})]
    assert len({c.id for c in parsed.tool_calls}) == 2
    # Not JSON inside the tags: no call, the text is content.
    assert HermesParser().parse("<tool_call>oops</tool_call>").tool_calls == []


def test_llama3_json_calls() -> None:
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    parsed = Llama3JsonParser().parse(text)
    assert parsed.content is None and calls(parsed) == [("a", {"x": 1}), ("b", {})]
    assert Llama3JsonParser().parse("Hello {not json").tool_calls == []
    assert Llama3JsonParser().parse("Hello").content == "Hello"


def test_mistral_both_formats() -> None:
    old = '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    assert calls(MistralParser().parse(old)) == [("a", {"x": 1}), ("b", {})]
    new = '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}'
    assert calls(MistralParser().parse(new)) == [("a", {"x": 1}), ("b", {})]
    assert MistralParser().parse("plain").content == "plain"


def test_parser_choice_from_config_or_template() -> None:
    assert parser_for("mistral", "<tool_call>").name == "mistral"
    assert parser_for(None, "... [TOOL_CALLS] ...").name == "mistral"
    assert parser_for(None, "{% if message.role == 'ipython' %}").name == "llama3_json"
    assert parser_for(None, "<tool_call>").name == "hermes"
    assert parser_for(None, None).name == "hermes"
    with pytest.raises(BadRequest, match="hermes, llama3_json, mistral"):
        parser_for("nope", None)


def test_auto_stream_sends_content_then_the_call_header_then_arguments() -> None:
    stream = ToolStream(ToolPlan("auto", [], parser=HermesParser()))
    pieces = ["Sure", ". <tool", '_call>{"name": "f", ', '"arguments": {"a": 1}}</tool_call>']
    deltas = [d for i, p in enumerate(pieces) for d in stream.push(p, i == len(pieces) - 1)]
    assert deltas[0] == {"content": "Sure"}
    # "<tool" is held back until it turns out to start a call.
    assert deltas[1] == {"content": ". "}
    header, arguments = deltas[2]["tool_calls"][0], deltas[3]["tool_calls"][0]
    assert header["id"].startswith("call_") and header["type"] == "function"
    assert header["function"] == {"name": "f", "arguments": ""}
    assert json.loads(arguments["function"]["arguments"]) == {"a": 1}
    assert "id" not in arguments and len(stream.calls) == 1
