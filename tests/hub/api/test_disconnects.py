"""Clients that leave a non-streamed generation free its work: completions, chat, generate and
responses abort their engine requests (KV blocks freed at once) when the caller disconnects,
while a caller that stays connected gets its whole answer."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from hub.settings import HubSettings
from tests.support.live import live_hub

PROMPT = "The harbour town woke slowly on winter mornings"
MESSAGES = [{"role": "user", "content": "Tell me a long story."}]
# Far more tokens than the tiny model generates before the leaving clients' timeout.
LONG = 1800


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def leaving_requests() -> list[tuple[str, dict[str, Any]]]:
    return [
        ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": LONG,
                             "ignore_eos": True}),
        ("/v1/completions", {"model": "tiny", "prompt": [PROMPT, "Once upon a time"],
                             "max_tokens": LONG, "ignore_eos": True, "n": 2}),
        ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": LONG,
                                  "ignore_eos": True}),
        ("/models/tiny/generate", {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}),
        ("/models/tiny/versions/1/generate", {"prompt": PROMPT, "max_tokens": LONG,
                                              "ignore_eos": True}),
        # The Responses API has no ignore_eos: a format that cannot be complete within
        # max_output_tokens (an array of at least LONG numbers) keeps it from ending on its
        # own before the client leaves.
        ("/v1/responses", {"model": "tiny", "input": "Tell me a long story.",
                           "max_output_tokens": LONG, "temperature": 0,
                           "text": {"format": {"type": "json_schema", "name": "numbers",
                                               "schema": {"type": "array", "minItems": LONG,
                                                          "items": {"type": "integer"}}}}}),
    ]  # fmt: skip


def test_non_streamed_clients_that_leave_abort_their_generation(
    settings: HubSettings, tiny_llm_dir: Path
) -> None:
    with live_hub(settings) as (base, _app):
        r = httpx.post(
            f"{base}/admin/registry/models",
            json={"name": "tiny", "kind": "llm", "source": str(tiny_llm_dir)},
        )
        assert r.status_code == 201, r.text
        # Loaded first, so the leaving clients time out while generating, not while loading.
        warm = httpx.post(
            f"{base}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}
        )
        assert warm.status_code == 200, warm.text

        outcomes: dict[int, str] = {}

        def leave(i: int, path: str, body: dict[str, Any]) -> None:
            try:
                r = httpx.post(f"{base}{path}", json=body, timeout=1.0)
                outcomes[i] = f"answered {r.status_code}: {r.text[:200]}"
            except httpx.TimeoutException:
                outcomes[i] = "left"

        requests = leaving_requests()
        threads = [
            threading.Thread(target=leave, args=(i, path, body))
            for i, (path, body) in enumerate(requests)
        ]
        for t in threads:
            t.start()
        # A caller that stays connected meanwhile gets its whole answer.
        stay = httpx.post(
            f"{base}/v1/completions",
            json={"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True},
            timeout=60,
        )
        for t in threads:
            t.join()
        # Every leaving client has timed out by now: what is generated from here on is
        # generation nobody waits for.
        at_leave = metric(httpx.get(f"{base}/metrics").text, "hub_llm_generation_tokens_total")
        assert stay.status_code == 200, stay.text
        assert stay.json()["usage"]["completion_tokens"] == 24
        assert outcomes == dict.fromkeys(range(len(requests)), "left")

        # Bounded: ~30 s at most, then the assertion names what is still held.
        for _ in range(300):
            text = httpx.get(f"{base}/metrics").text
            held = {
                name: metric(text, name)
                for name in (
                    "hub_llm_running_sequences",
                    "hub_llm_waiting_sequences",
                    "hub_llm_kv_cache_usage_ratio",
                )
            }
            if not any(held.values()):
                break
            time.sleep(0.1)
        assert not any(held.values()), f"the leaving clients' work still runs: {held}"
        [status] = httpx.get(f"{base}/admin/models").json()
        assert status["in_flight"] == 0, "a non-streamed request never released the model"
        # Aborted, not generated to the end: 7 sequences asked for LONG tokens each, and once
        # their clients had left each made at most a few more steps' tokens.
        generated = metric(text, "hub_llm_generation_tokens_total")
        assert generated < 7 * LONG
        assert generated - at_leave < 7 * 100, (at_leave, generated)
        lines = [line for line in text.splitlines() if line.startswith("hub_requests_total{")]
        gone = sum(float(line.split()[-1]) for line in lines if 'status="499"' in line)
        assert gone == len(requests), lines
