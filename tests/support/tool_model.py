"""A tiny random-weight LLM whose chat template shows tools the Hermes / Qwen way.

The template lists the tools as JSON inside `<tools>`, writes an assistant turn's calls as
`<tool_call>{"name", "arguments"}</tool_call>` and a tool's answer as `<tool_response>`, as
Qwen 2.5's template does, on the tiny tokenizer's role tokens.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx

from hub.settings import HubSettings
from tests.support.live import live_hub

TOOL_CHAT_TEMPLATE = """{{ bos_token }}
{%- if tools %}<|system|>
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function as <tool_call>{"name": ..., "arguments": ...}</tool_call>{{ eos_token }}
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools and loop.first %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|assistant|>
{{ message.content or '' }}
{%- for call in message.tool_calls %}<tool_call>{"name": "{{ call.function.name }}", \
"arguments": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}{{ eos_token }}
{% elif message.role == 'tool' %}<|user|>
<tool_response>{{ message.content }}</tool_response>{{ eos_token }}
{% else %}<|{{ message.role }}|>
{{ message.content }}{{ eos_token }}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""


def build_tool_llm(source: Path, out_dir: Path) -> Path:
    """A copy of the tiny model in `source` with the tool-aware chat template."""
    if not (out_dir / "config.json").is_file():
        shutil.copytree(source, out_dir, dirs_exist_ok=True)
        (out_dir / "chat_template.jinja").write_text(TOOL_CHAT_TEMPLATE.replace("\\\n", ""))
    return out_dir


@contextlib.contextmanager
def serving_tool_llm(settings: HubSettings, model_dir: Path) -> Iterator[str]:
    """A live hub (a real socket, for the SDKs) with the tool model registered as `tiny`;
    yields its base URL."""
    with live_hub(settings) as (url, _app):
        r = httpx.post(
            f"{url}/admin/registry/models",
            json={"name": "tiny", "kind": "llm", "source": str(model_dir)},
            timeout=120,
        )
        assert r.status_code == 201, r.text
        yield url
