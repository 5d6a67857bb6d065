"""The Responses API with the openai SDK (`responses.create` and `responses.stream`) on a
tiny random-weight model: text, text.format json_schema, function tools (required, named,
and calls plus their outputs in the input), typed stream events, statelessness."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from hub.settings import HubSettings
from tests.hub.api.test_structured import PERSON, SCHEMAS, openai_client
from tests.support.tool_model import serving_tool_llm

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": SCHEMAS["get_weather"],
}


@pytest.fixture(scope="module")
def tool_llm_dir(tiny_llm_dir: Path) -> Path:
    """The tiny LLM: its own chat template renders tools, calls and tool results."""
    return tiny_llm_dir


@pytest.fixture
def client(settings: HubSettings, tool_llm_dir: Path) -> Iterator[Any]:
    with serving_tool_llm(settings, tool_llm_dir) as url:
        yield openai_client(url)


def test_text_and_json_schema_create_and_stream(client: Any) -> None:
    plain = client.responses.create(
        model="tiny",
        input="Hello there",
        instructions="Be brief.",
        max_output_tokens=8,
        temperature=0,
        store=True,
        metadata={"k": "v"},
    )
    assert plain.object == "response" and plain.status in ("completed", "incomplete")
    assert plain.output[0].type == "message" and plain.output_text
    assert plain.usage.output_tokens == 8 or plain.status == "completed"

    with client.responses.stream(
        model="tiny",
        input="Hello there",
        instructions="Be brief.",
        max_output_tokens=8,
        temperature=0,
    ) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds
    # Cut by max_output_tokens, as OpenAI ends such a stream: response.incomplete.
    assert kinds[-1] == (
        "response.completed" if plain.status == "completed" else "response.incomplete"
    )
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-1].response.output_text

    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    structured = client.responses.create(
        model="tiny", input="Who?", text={"format": fmt}, max_output_tokens=80, temperature=0
    )
    if structured.status == "completed":
        jsonschema.validate(json.loads(structured.output_text), PERSON)
    assert structured.text.format.type == "json_schema"


def test_function_tools_create_stream_and_call_outputs_in_the_input(client: Any) -> None:
    ask = {
        "model": "tiny",
        "input": "Weather in Paris?",
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 120,
        "temperature": 0,
    }
    required = client.responses.create(**ask)
    (whole,) = [item for item in required.output if item.type == "function_call"]
    assert required.status == "completed" and whole.name == "get_weather"
    jsonschema.validate(json.loads(whole.arguments), SCHEMAS["get_weather"])
    # Streamed, a required call's arguments arrive in fragments as they are generated,
    # after the item that announces the call.
    with client.responses.stream(**ask) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    added = kinds.index("response.output_item.added")
    assert events[added].item.type == "function_call"
    assert events[added].item.name == "get_weather" and events[added].item.arguments == ""
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(fragments) > 1 and kinds.index("response.function_call_arguments.delta") > added
    assert "".join(fragments) == whole.arguments

    named = {"type": "function", "name": "get_weather"}
    with client.responses.stream(
        model="tiny",
        input="Weather in Paris?",
        tools=[WEATHER_TOOL],
        tool_choice=named,
        max_output_tokens=80,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(fragments) == call.arguments
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])

    follow_up = client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
        tools=[WEATHER_TOOL],
        max_output_tokens=4,
        temperature=0,
    )
    assert follow_up.usage.input_tokens > final.usage.input_tokens


def test_stored_state_is_refused_and_unknown_fields_too(client: Any) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_1")
    assert "stateless" in info.value.message
    with pytest.raises(openai.APIStatusError) as refused:
        client.responses.create(model="tiny", input="hi", extra_body={"no_such_field": 1})
    # 422 until validation errors answer 400.
    assert refused.value.status_code in (400, 422) and "no_such_field" in refused.value.message
