"""Tool calls as a newcomer runs them on the demo LLM (configs/demo.yaml's `tiny-llama`, built
by `builtin:tiny-llm`) with the openai SDK: a two-turn loop (a call, then the tool's result in
the history)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.hub.api.test_structured import WEATHER, openai_client
from tests.support.hubs import make_settings
from tests.support.live import live_hub

REPO = Path(__file__).resolve().parents[3]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


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
