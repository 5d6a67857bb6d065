"""Streamed chunks rendered from a template are the bytes the general path makes of the same
chunk, whatever the text holds (quotes, escapes, control characters, any script)."""

from __future__ import annotations

import json

import pytest

from hub.api.sse import INDEX, TEXT, ChunkTemplate, event

HEAD = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": 'tiny"model'}
TEXTS = ["", "plain", ' "quoted" ', "back\\slash", "line\nbreak\ttab\r", "\x00\x1f\x7f",
         "é ü ß 中文 🙂", "\u2028\u2029", "\ue000index\ue001"]  # fmt: skip


@pytest.mark.parametrize("text", TEXTS)
def test_a_rendered_chunk_equals_the_event_of_the_same_chunk(text: str) -> None:
    fields = {"logprobs": None, "finish_reason": None, "stop_reason": None}
    template = ChunkTemplate({**HEAD, "choices": [{"index": INDEX, "text": TEXT, **fields}]})
    rendered = template.render(3, text)
    assert rendered == event({**HEAD, "choices": [{"index": 3, "text": text, **fields}]})
    assert rendered.startswith(b"data: ") and rendered.endswith(b"\n\n")
    assert json.loads(rendered[6:])["choices"][0]["text"] == text


def test_a_chat_delta_template_keeps_the_keys_in_order() -> None:
    template = ChunkTemplate(
        {**HEAD, "usage": None, "choices": [{"index": INDEX, "delta": {"content": TEXT},
                                             "finish_reason": None, "logprobs": None}]}
    )  # fmt: skip
    chunk = json.loads(template.render(0, "hi")[6:])
    assert list(chunk) == ["id", "object", "created", "model", "usage", "choices"]
    assert chunk["choices"] == [
        {"index": 0, "delta": {"content": "hi"}, "finish_reason": None, "logprobs": None}
    ]


def test_a_template_without_both_stand_ins_is_refused() -> None:
    with pytest.raises(ValueError, match="INDEX"):
        ChunkTemplate({**HEAD, "choices": [{"index": 0, "text": TEXT}]})
    with pytest.raises(ValueError, match="INDEX"):
        ChunkTemplate({"model": INDEX, "choices": [{"index": INDEX, "text": TEXT}]})
