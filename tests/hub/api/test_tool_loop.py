"""Tool calls as a newcomer runs them on the demo LLM (configs/demo.yaml's `tiny-llama`, built
by `builtin:tiny-llm`) with the openai SDK: a two-turn loop (a call, then the tool's result in
the history), and a call cut by max_tokens, which comes back as a call with its partial
arguments and finish_reason `length` whether streamed or not (a `function_call` item marked
incomplete in the Responses API), as OpenAI answers it; LangChain then sees an invalid tool
call, not text content."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from tests.hub.api.test_structured import WEATHER, openai_client, streamed_calls
from tests.support.hubs import make_settings
from tests.support.live import live_hub

REPO = Path(__file__).resolve().parents[3]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# A Hermes call the grammar makes the random model write, for tool_choice auto.
HERMES_CALL = (
    r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "c"\}\}'
    r"</tool_call>"
)
# The shape of a chat answer a client sees: content, (name, arguments) per call, finish.
Shape = tuple[str | None, list[tuple[str, str]], str | None]


class WeatherQuery(BaseModel):
    """The weather in a city."""

    city: str
    unit: str


@dataclass
class Demo:
    base: str
    client: Any
    model_dir: Path  # where `builtin:tiny-llm` was built


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, mlflow_template: Path) -> Iterator[Demo]:
    """A live hub serving the demo config's LLM as `tiny`, built from `builtin:tiny-llm`."""
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    (llm,) = [m for m in config["models"] if m["source"] == "builtin:tiny-llm"]
    root = tmp_path_factory.mktemp("demo-tools")
    settings = make_settings(root, mlflow_template, models=[{**llm, "name": "tiny"}])
    with live_hub(settings) as (url, _app):
        yield Demo(url, openai_client(url), settings.demo_dir / "tiny-llm")


def test_a_two_turn_tool_loop_on_the_demo_model(demo: Demo) -> None:
    client = demo.client
    first = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice=NAMED, max_tokens=60,
        temperature=0,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)

    # The SDK's own message goes back into the history, then the tool's answer.
    result = "sunny, 21 C"
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    second = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert second.choices[0].message.role == "assistant"
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")

    # The prompt is the demo template's rendering of the tools, the call and the result,
    # the Hermes / Qwen 2.5 way.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo.model_dir)
    assistant = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": arguments},
            }
        ],
    }
    rendered = tokenizer.apply_chat_template(
        [*ASK, assistant, {"role": "tool", "tool_call_id": call.id, "content": result}],
        tools=[WEATHER],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in rendered
    written = json.dumps(arguments, ensure_ascii=False)
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {written}}}\n</tool_call>' in (
        rendered
    )
    assert f"<|user|>\n<tool_response>\n{result}\n</tool_response><|eos|>" in rendered
    assert second.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


def test_a_cut_call_is_a_call_streamed_or_not(demo: Demo) -> None:
    client = demo.client
    # A named tool_choice (LangChain's function_calling): cut inside the arguments.
    named = {"model": "tiny", "messages": ASK, "tools": [WEATHER], "tool_choice": NAMED}
    whole, streamed = both_ways(client, **named, max_tokens=4, temperature=0)
    assert whole == streamed
    content, ((name, arguments),), finish = whole
    assert (content, name, finish) == (None, "get_weather", "length")
    assert arguments.startswith("{") and not is_json(arguments)

    # tool_choice auto, the model writing a Hermes call (forced by a grammar): cut after
    # its name, inside the arguments. Where is decided from the uncut answer's tokens.
    auto = {"model": "tiny", "messages": ASK, "tools": [WEATHER], "temperature": 0}
    forced = {"guided_regex": HERMES_CALL}
    uncut = client.chat.completions.create(**auto, max_tokens=80, logprobs=True, extra_body=forced)
    tokens = [t.token for t in uncut.choices[0].logprobs.content]
    cut = next(k for k in range(len(tokens)) if '"city": "P' in "".join(tokens[:k]))
    whole, streamed = both_ways(client, **auto, max_tokens=cut, extra_body=forced)
    assert whole == streamed
    content, ((name, arguments),), finish = whole
    assert (content, name, finish) == (None, "get_weather", "length")
    assert arguments.startswith('{"city": "P') and not is_json(arguments)


def both_ways(client: Any, **ask: Any) -> tuple[Shape, Shape]:
    """The shape of the same request answered whole and streamed (assembled as a client
    accumulates the deltas)."""
    whole = client.chat.completions.create(**ask).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    chunks = list(client.chat.completions.create(**ask, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) or None
    streamed = [(name, "".join(f)) for _, name, f in streamed_calls(chunks).get(0, [])]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    return (whole.message.content, calls, whole.finish_reason), (content, streamed, finish)


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_langchain_sees_a_cut_call_as_openai_sends_it(demo: Demo) -> None:
    """LangChain's `with_structured_output(method="function_calling")` gets the cut call
    among the raw message's invalid_tool_calls with finish_reason `length`, as from OpenAI,
    not as text content it cannot tell from an answer."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model="tiny", base_url=f"{demo.base}/v1", api_key="unused", temperature=0,
        max_tokens=4, max_retries=0, timeout=300,
    )  # fmt: skip
    out = llm.with_structured_output(
        WeatherQuery, method="function_calling", include_raw=True
    ).invoke("Weather in Paris?")
    raw = out["raw"]
    assert raw.response_metadata["finish_reason"] == "length"
    assert raw.content == "" and raw.tool_calls == []
    (cut,) = raw.invalid_tool_calls
    assert cut["name"] == "WeatherQuery" and cut["args"].startswith("{")
    assert cut["id"].startswith("call_")


def test_responses_mark_the_cut_item_incomplete(demo: Demo) -> None:
    client = demo.client
    tool = {"type": "function", **WEATHER["function"]}
    ask = {
        "model": "tiny",
        "input": "Weather in Paris?",
        "tools": [tool],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 4,
        "temperature": 0,
    }
    whole = client.responses.create(**ask)
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    (call,) = whole.output
    assert call.type == "function_call" and call.status == "incomplete"
    assert call.arguments.startswith("{") and not is_json(call.arguments)

    with client.responses.stream(**ask) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    (done,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert (done.type, done.status, done.name) == ("function_call", "incomplete", call.name)
    assert done.arguments == call.arguments
    (final,) = events[-1].response.output
    assert final.status == "incomplete" and final.arguments == call.arguments

    # A text answer cut short: its message item is incomplete, with the text it has.
    text = client.responses.create(model="tiny", input="Hello", max_output_tokens=3, temperature=0)
    assert text.status == "incomplete"
    (message,) = text.output
    assert message.status == "incomplete" and text.output_text
