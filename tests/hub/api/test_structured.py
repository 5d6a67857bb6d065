"""Structured outputs and tool calls over HTTP with the real clients (the openai SDK and
LangChain) on a tiny random-weight model: whatever finishes follows its schema, tool
arguments match their function's schema, streams carry OpenAI's delta shapes, and what the
grammar library cannot handle is a 400 before anything runs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from hub.settings import HubSettings
from tests.support.tool_model import serving_tool_llm

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {
    "get_weather": WEATHER["function"]["parameters"],
    "get_time": TIME["function"]["parameters"],
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    """LangChain's structured output target."""

    name: str = Field(min_length=1, max_length=8)
    role: Literal["admin", "user"]


class WeatherQuery(BaseModel):
    """A LangChain tool: the weather in a city."""

    city: str = Field(min_length=1, max_length=8)
    unit: Literal["c", "f"]


@pytest.fixture(scope="module")
def tool_llm_dir(tiny_llm_dir: Path) -> Path:
    """The tiny LLM: its own chat template renders tools, calls and tool results."""
    return tiny_llm_dir


@pytest.fixture
def base(settings: HubSettings, tool_llm_dir: Path) -> Iterator[str]:
    with serving_tool_llm(settings, tool_llm_dir) as url:
        yield url


def openai_client(base: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


def test_response_format_json_schema_strict_and_vllm_fields(base: str) -> None:
    client = openai_client(base)
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    chat = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        response_format=fmt,
        max_tokens=80,
        n=3,
        temperature=1.0,
        seed=3,
    )
    finished = [c for c in chat.choices if c.finish_reason == "stop"]
    assert finished, "no constrained output finished"
    for c in finished:
        jsonschema.validate(json.loads(c.message.content), PERSON)

    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            response_format=fmt,
            max_tokens=80,
            temperature=0,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(
        model="tiny", messages=ASK, response_format=fmt, max_tokens=80, temperature=0
    )
    assert text == whole.choices[0].message.content
    if whole.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(text), PERSON)

    obj = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    )
    assert obj.choices[0].message.content.startswith("{")

    for extra, check in [
        ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda t: len(t) == 6),
        ({"guided_grammar": 'start: "ok" | "no"'}, lambda t: t in ("ok", "no")),
    ]:
        out = client.completions.create(
            model="tiny", prompt="Answer:", max_tokens=80, temperature=0, extra_body=extra
        )
        assert out.choices[0].finish_reason == "stop", extra
        assert check(out.choices[0].text), (extra, out.choices[0].text)

    legacy = client.completions.create(
        model="tiny",
        prompt="Answer:",
        max_tokens=80,
        n=3,
        temperature=1.0,
        seed=5,
        extra_body={"guided_json": PERSON},
    )
    done = [c.text for c in legacy.choices if c.finish_reason == "stop"]
    assert done and all(jsonschema.validate(json.loads(t), PERSON) is None for t in done)

    r = httpx.post(
        timeout=300,
        url=f"{base}/models/tiny/generate",
        json={"prompt": "Code:", "structured_outputs": {"regex": "[A-Z]{4}"}, "max_tokens": 10},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].isupper() and len(r.json()["choices"][0]["text"]) == 4


def test_an_unsupported_schema_is_a_400_naming_it(base: str) -> None:
    import openai

    client = openai_client(base)
    bad = {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}},
        )
    assert 'Unimplemented keys: ["if", "then"]' in info.value.message
    assert info.value.param == "response_format"
    r = httpx.post(
        timeout=300,
        url=f"{base}/v1/completions",
        json={"model": "tiny", "prompt": "a", "guided_regex": "(", "guided_choice": ["a"]},
    )
    assert r.status_code == 400 and "one output constraint" in r.json()["error"]["message"]
    r = httpx.post(
        timeout=300,
        url=f"{base}/v1/completions",
        json={"model": "tiny", "prompt": "a", "guided_regex": "(a"},
    )
    assert r.status_code == 400 and "regex" in r.json()["error"]["message"]
    # The engine is untouched: a good request still runs.
    ok = client.completions.create(model="tiny", prompt="a", max_tokens=3)
    assert ok.choices[0].text is not None


def test_required_and_named_tool_calls_match_their_schemas(base: str) -> None:
    client = openai_client(base)
    required = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=120,
        temperature=1.0,
        seed=3,
        n=3,
    )
    called = 0
    for choice in required.choices:
        if choice.finish_reason == "length":
            continue
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            called += 1
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert called

    single = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    if single.choices[0].finish_reason == "tool_calls":
        assert len(single.choices[0].message.tool_calls) == 1

    named = {"type": "function", "function": {"name": "get_time"}}
    whole = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=named,
        max_tokens=60,
        temperature=0,
    )
    assert whole.choices[0].finish_reason == "tool_calls"
    call = whole.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])

    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=named,
            max_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    head = deltas[0].tool_calls[0]
    assert head.id and head.type == "function" and head.function.name == "get_time"
    assert head.function.arguments == ""
    fragments = [d.tool_calls[0].function.arguments for d in deltas[1:]]
    assert len(fragments) > 1 and all(d.tool_calls[0].id is None for d in deltas[1:])
    assert "".join(fragments) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    # Required calls stream as named ones do: parallel calls each with their own index,
    # the same calls and arguments as the same request unstreamed.
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in (WEATHER, TIME)]
    ask = {"model": "tiny", "messages": ASK, "tools": strict, "tool_choice": "required"}
    sample = {"max_tokens": 300, "n": 6, "temperature": 1.0, "seed": 1}
    chunks = list(client.chat.completions.create(**ask, **sample, stream=True))
    streamed = streamed_calls(chunks)
    finished = {c.index: c.finish_reason for k in chunks for c in k.choices if c.finish_reason}
    whole_required = client.chat.completions.create(**ask, **sample)
    for choice in whole_required.choices:
        assert finished[choice.index] == choice.finish_reason
        if choice.finish_reason != "tool_calls":
            continue
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert calls == [(n, "".join(f)) for _, n, f in streamed[choice.index]]
        assert all(len(f) > 1 for _, _, f in streamed[choice.index])  # not sent whole
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert max(len(calls) for calls in streamed.values()) > 1, "no parallel calls to check"

    # The SDK's stream helper (ChatCompletionStreamState) accumulates the deltas.
    with client.chat.completions.stream(
        **ask, parallel_tool_calls=False, max_tokens=120, n=3, temperature=1.0, seed=1
    ) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    streamed = streamed_calls(chunks)
    for choice in final.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        ((call_id, name, fragments),) = streamed[choice.index]
        assert (call.id, call.function.name) == (call_id, name)
        assert call.function.arguments == "".join(fragments)
        assert call.function.parsed_arguments == json.loads(call.function.arguments)
        jsonschema.validate(call.function.parsed_arguments, SCHEMAS[name])


def streamed_calls(chunks: list[Any]) -> dict[int, list[tuple[str, str, list[str]]]]:
    """Per choice, its calls as OpenAI streams them: (id, name, argument fragments). Checks
    the shape: a call's first delta has its id, type and name with empty arguments, the
    later ones only argument fragments; calls are numbered 0, 1, ... in order."""
    calls: dict[int, list[tuple[str, str, list[str]]]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                mine = calls.setdefault(choice.index, [])
                if delta.id is not None:
                    assert delta.index == len(mine) and delta.type == "function"
                    assert delta.function.name and delta.function.arguments == ""
                    mine.append((delta.id, delta.function.name, []))
                else:
                    assert delta.index == len(mine) - 1 and delta.function.name is None
                    mine[-1][2].append(delta.function.arguments)
    return calls


def test_auto_tool_calls_are_parsed_and_history_with_tool_turns_renders(
    base: str, tool_llm_dir: Path
) -> None:
    """A random model does not call tools on its own; a grammar makes it write a Hermes
    call, which the auto parser must turn into tool_calls (plain and streamed)."""
    client = openai_client(base)
    forced = {
        "guided_regex": r'Sure\.<tool_call>\{"name": "get_weather", "arguments": '
        r'\{"city": "Paris", "unit": "c"\}\}</tool_call>'
    }
    chat = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        max_tokens=80,
        temperature=0,
        extra_body=forced,
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}

    # Streamed, with two parallel calls: content first, then each call with its own index,
    # its header once the name is complete and its arguments in fragments as generated.
    two = {
        "guided_regex": forced["guided_regex"]
        + r'\n<tool_call>\{"name": "get_time", "arguments": \{"zone": -3\}\}</tool_call>'
    }
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=[WEATHER, TIME],
            max_tokens=300,
            temperature=0,
            extra_body=two,
            stream=True,
        )
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Sure."
    (calls,) = streamed_calls(chunks).values()
    assert [(name, json.loads("".join(f))) for _, name, f in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("get_time", {"zone": -3}),
    ]
    assert all(len(f) > 1 for _, _, f in calls)
    # A false start (`<tool_call>` then no call) is content, streamed and not.
    false_start = {"guided_regex": r"<tool_call>oops</tool_call>"}
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=[WEATHER],
            max_tokens=40,
            temperature=0,
            extra_body=false_start,
            stream=True,
        )
    )
    assert not streamed_calls(chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "<tool_call>oops</tool_call>"

    # tool_choice none: plain text, no calls parsed even if the text looks like one.
    none = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=80,
        temperature=0,
        extra_body=forced,
    )
    assert none.choices[0].message.tool_calls is None
    assert "<tool_call>" in none.choices[0].message.content

    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    answer = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER], max_tokens=5, temperature=0
    )
    # The prompt is the template's rendering of the calls and the tool's answer.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_llm_dir)
    rendered = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": {"city": "Paris", "unit": "c"},
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    text = tokenizer.apply_chat_template(
        rendered, tools=[WEATHER], tokenize=False, add_generation_prompt=True
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert "<|user|>\n<tool_response>\nsunny, 21 C\n</tool_response><|eos|>" in text
    assert answer.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))

    r = httpx.post(
        timeout=300,
        url=f"{base}/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": ASK,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_langchain_structured_output_and_bind_tools(base: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model="tiny",
        base_url=f"{base}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=60,
        max_retries=0,
        timeout=300,
    )
    person = llm.with_structured_output(Person, method="json_schema").invoke("Who is it?")
    assert isinstance(person, Person)

    bound = llm.bind_tools([WeatherQuery], tool_choice="WeatherQuery")
    message = bound.invoke("Weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "WeatherQuery" and set(call["args"]) == {"city", "unit"}
    assert call["args"]["unit"] in ("c", "f")
