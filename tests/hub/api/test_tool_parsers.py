"""Tool-call parsers per model family, their choice from the runtime config or the chat
template, and the streaming of parsed calls in OpenAI's delta shape: decided as the text
arrives, the same calls and content whatever the deltas' sizes."""

from __future__ import annotations

import json

import pytest

from hub.api.tool_parsers import ToolParser, parser_for
from hub.api.tool_parsers.constrained import NamedCall, RequiredCalls
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
    # "<tool" is held back until it turns out to start a call, and the blank before it
    # until it turns out to be followed by one.
    assert deltas[1] == {"content": "."}
    header, arguments = deltas[2]["tool_calls"][0], deltas[3]["tool_calls"][0]
    assert header["id"].startswith("call_") and header["type"] == "function"
    assert header["function"] == {"name": "f", "arguments": ""}
    assert json.loads(arguments["function"]["arguments"]) == {"a": 1}
    assert "id" not in arguments and len(stream.calls) == 1


def streamed(parser: ToolParser, pieces: list[str], parallel: bool = True) -> list[dict]:
    stream = ToolStream(ToolPlan("auto", [], parser=parser), parallel)
    return [d for i, p in enumerate(pieces) for d in stream.push(p, i == len(pieces) - 1)]


def assembled(deltas: list[dict]) -> tuple[str, list[tuple[str, object]]]:
    """Content and (name, arguments) per call, as a client accumulates the deltas."""
    content, calls = "", []
    for d in deltas:
        content += d.get("content", "")
        for call in d.get("tool_calls", []):
            if "id" in call:
                assert call["index"] == len(calls) and call["function"]["arguments"] == ""
                calls.append([call["function"]["name"], ""])
            else:
                assert call["index"] == len(calls) - 1
                calls[-1][1] += call["function"]["arguments"]
    return content, [(n, json.loads(a)) for n, a in calls]


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (HermesParser(), 'Hi <b>\n<tool_call>\n{"name": "f", "arguments": {"s": "}\\"{"}}\n'
         '</tool_call>\n<tool_call>{"arguments": {"z": [1, 2]}, "name": "g"}</tool_call>'),
        (Llama3JsonParser(), ' <|python_tag|>{"name": "f", "parameters": {"a": 1}}; '
         '{"name": "g", "parameters": {"b": "x"}}'),
        (MistralParser(), 'Ok [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, '
         '{"name": "g", "arguments": {}}]'),
        (MistralParser(), '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{"b": null}'),
        (RequiredCalls(), '[{"name": "f", "arguments": {"a": -1.5}}, {"name": "g", '
         '"arguments": {"t": true}}]'),
    ],
)  # fmt: skip
def test_streaming_any_split_gives_the_parse_of_the_whole(parser: ToolParser, text: str) -> None:
    whole = parser.parse(text)
    assert [c.name for c in whole.tool_calls] == ["f", "g"]
    expected = [(c.name, json.loads(c.arguments)) for c in whole.tool_calls]
    for size in (1, 3, 7, len(text)):
        deltas = streamed(parser, [text[i : i + size] for i in range(0, len(text), size)])
        content, calls = assembled(deltas)
        assert calls == expected, size
        assert content == (whole.content or "")
    # One character at a time, the arguments go out as they arrive, not once complete.
    fragments = [d for d in streamed(parser, list(text)) if "tool_calls" in d]
    assert len(fragments) > 2 * len(expected)
    # One call asked for: the later ones are not sent.
    assert assembled(streamed(parser, list(text), parallel=False))[1] == expected[:1]


def test_false_starts_stream_as_content() -> None:
    for parser, text in [
        (HermesParser(), "a <tool_call>oops</tool_call> b"),
        (HermesParser(), 'x <tool_call>{"city": "Paris"}</tool_call>'),
        (HermesParser(), '<tool_call>{"name": "get_we'),  # cut before the name was whole
        (Llama3JsonParser(), '  {"answer": 42}'),
        (Llama3JsonParser(), "Hello {not json"),
        (MistralParser(), "see [TOOL_CALLS] later"),
    ]:
        for pieces in (list(text), [text]):
            assert assembled(streamed(parser, pieces)) == (text, []), (parser.name, text)
        assert parser.parse(text).tool_calls == [] and parser.parse(text).content == text


def raw_calls(deltas: list[dict]) -> list[tuple[str, str]]:
    """(name, arguments text) per call as a client accumulates them, JSON or not."""
    out: list[list[str]] = []
    for d in deltas:
        for call in d.get("tool_calls", []):
            if "id" in call:
                out.append([call["function"]["name"], ""])
            else:
                out[-1][1] += call["function"]["arguments"]
    return [(n, a) for n, a in out]


@pytest.mark.parametrize(
    ("parser", "text", "content", "cut"),
    [
        (HermesParser(), 'Let me see.\n<tool_call>\n{"name": "f", "arguments": {"city": "Pa',
         "Let me see.", [("f", '{"city": "Pa')]),
        (HermesParser(), '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n'
         '<tool_call>{"name": "g", "arg', None, [("f", '{"a": 1}'), ("g", "")]),
        (HermesParser(), '<tool_call>{"name": "f", "arguments": {"a": 1,, }}</tool_call>',
         None, [("f", '{"a": 1,, }')]),
        (Llama3JsonParser(), '{"name": "f", "parameters": {"a": [1, 2', None,
         [("f", '{"a": [1, 2')]),
        (MistralParser(), 'Ok [TOOL_CALLS]f[ARGS]{"a": tr', "Ok", [("f", '{"a": tr')]),
        (RequiredCalls(), '[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {',
         None, [("f", '{"a": 1}'), ("g", "{")]),
        (NamedCall("f"), '{"city": "Par', None, [("f", '{"city": "Par')]),
    ],
)  # fmt: skip
def test_a_call_cut_short_is_still_a_call_streamed_or_not(
    parser: ToolParser, text: str, content: str | None, cut: list[tuple[str, str]]
) -> None:
    """As OpenAI answers a call cut by max_tokens: the call with the arguments generated so
    far, whole and streamed alike (the finish_reason, `length`, says it is cut)."""
    whole = parser.parse(text)
    assert whole.content == content
    assert [(c.name, c.arguments) for c in whole.tool_calls] == cut
    for size in (1, 4, len(text)):
        deltas = streamed(parser, [text[i : i + size] for i in range(0, len(text), size)])
        assert raw_calls(deltas) == cut, size
        assert "".join(d.get("content", "") for d in deltas) == (content or ""), size


def test_blank_before_a_call_is_not_content_but_a_blank_tail_is() -> None:
    for pieces in (list("Hi \n"), ["Hi \n"]):
        assert assembled(streamed(HermesParser(), pieces)) == ("Hi \n", [])
    text = 'Hi \n<tool_call>oops</tool_call> \n<tool_call>{"name": "f", "arguments": {}}'
    assert HermesParser().parse(text).content == "Hi \n<tool_call>oops</tool_call>"
    for size in (1, len(text)):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        assert assembled(streamed(HermesParser(), pieces)) == (
            "Hi \n<tool_call>oops</tool_call>",
            [("f", {})],
        )
