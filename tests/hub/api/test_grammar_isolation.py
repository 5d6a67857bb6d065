"""Grammar compiles cannot stall the hub: choice lists over a model's limits are refused at
once, one caller's compiles hold one thread of the grammar pool and a bounded share of it,
loads and unloads never wait for compiles, a compile past its time limit is a 503 naming
it, and a queued compile whose client left never runs.

Slow compiles are made by gating `GrammarCompiler.compile` (the function the pool runs) on
an event the test opens: every ordering below is decided by the test, not by timing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.llm.structured import StructuredOutput
from backends.llm.structured.compiler import GrammarCompiler
from registry.db import Database
from registry.keys import ApiKeys
from tests.support.hubs import ADMIN, auth_settings
from tests.support.live import live_hub

# Bound on any wait in these tests: a hang guard, never reached when they pass.
GUARD_S = 60.0


class Gate:
    """Holds every choice-list compile until `open`; records which ones started."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started: list[str] = []
        self._open = threading.Event()
        self._cond = threading.Condition()
        real = GrammarCompiler.compile

        def compile(compiler: GrammarCompiler, spec: StructuredOutput, **kw: Any) -> Any:
            if spec.kind == "choice":
                with self._cond:
                    self.started.append(spec.source)
                    self._cond.notify_all()
                assert self._open.wait(GUARD_S), "the test never opened the gate"
            return real(compiler, spec, **kw)

        monkeypatch.setattr(GrammarCompiler, "compile", compile)

    def open(self) -> None:
        self._open.set()

    async def until_started(self, count: int) -> None:
        def wait() -> bool:
            with self._cond:
                return self._cond.wait_for(lambda: len(self.started) >= count, GUARD_S)

        assert await asyncio.to_thread(wait), f"{len(self.started)} compiles started"


def choice_body(choices: list[str]) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "a", "max_tokens": 2,
            "structured_outputs": {"choice": choices}}  # fmt: skip


JSON_OBJECT = {"model": "tiny", "prompt": "a", "max_tokens": 3,
               "response_format": {"type": "json_object"}}  # fmt: skip


@pytest.fixture
def hub(
    tmp_path: Path, mlflow_template: Path, tiny_llm_dir: Path, tiny_embedder_dir: Path
) -> Iterator[tuple[str, Any, dict[str, dict[str, str]]]]:
    """A live hub with API keys "app", "other" and "leaver", the tiny LLM loaded and a tiny
    embedder loaded as "emb"; yields (URL, the Hub, headers by key name)."""
    settings, app_key = auth_settings(tmp_path, mlflow_template)
    keys = ApiKeys(Database(settings.database_url))
    headers = {"app": {"Authorization": f"Bearer {app_key}"}}
    for name in ("other", "leaver"):
        headers[name] = {"Authorization": f"Bearer {keys.create(name, 'user')[0]}"}
    with live_hub(settings) as (url, app):
        for name, kind, folder, config in (
            ("tiny", "llm", tiny_llm_dir, {"grammar_compile_timeout_ms": 600_000}),
            ("emb", "embedder", tiny_embedder_dir, {}),
        ):
            body = {"name": name, "kind": kind, "source": str(folder), "config": config}
            r = httpx.post(f"{url}/admin/registry/models", json=body, headers=ADMIN, timeout=120)
            assert r.status_code == 201, r.text
            r = httpx.post(f"{url}/admin/models/{name}/versions/1/load", headers=ADMIN, timeout=120)
            assert r.status_code == 200, r.text
        yield url, app.state.hub, headers


def test_large_choice_lists_are_refused_at_once_while_others_are_served(
    hub: tuple[str, Any, dict[str, dict[str, str]]],
) -> None:
    url, _, headers = hub
    # 40,000 choices (about 0.9 MB): over the default limits of 4,096 choices and 128 KiB.
    big = [f"option-{i}-abcdef" for i in range(40_000)]
    finished: list[str] = []

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=GUARD_S) as client:

            async def send(tag: str, path: str, body: Any, who: str = "app") -> httpx.Response:
                r = await client.post(path, json=body, headers=headers[who])
                finished.append(tag if r.status_code != 400 else f"{tag} refused")
                return r

            bigs = [
                asyncio.create_task(send("big", "/v1/completions", choice_body(big[i:] + big[:i])))
                for i in range(6)
            ]
            small = await send("small", "/v1/completions", JSON_OBJECT, who="other")
            unload = await client.post("/admin/models/emb/versions/1/unload", headers=ADMIN)
            finished.append("unload")
            assert small.status_code == 200, small.text
            assert unload.status_code == 200 and unload.json()["state"] == "unloaded"
            for r in await asyncio.gather(*bigs):
                assert r.status_code == 400, r.text[:300]
                error = r.json()["error"]
                assert "max_choices" in error["message"] and error["param"] == "structured_outputs"

    asyncio.run(scenario())
    # No large list was compiled and answered ahead of the small request.
    assert "big" not in finished[: finished.index("small")]
    # A lark grammar over its limit is refused the same way.
    rules = "\n".join(f'r{i}: "x{i}"' for i in range(20_000))
    lark = {
        "model": "tiny",
        "prompt": "a",
        "structured_outputs": {"grammar": f"start: r0\n{rules}"},
    }
    r = httpx.post(f"{url}/v1/completions", json=lark, headers=headers["app"], timeout=GUARD_S)
    assert r.status_code == 400 and "max_grammar_bytes" in r.json()["error"]["message"], r.text


def test_one_callers_compiles_leave_the_pool_to_other_callers_and_to_unloads(
    hub: tuple[str, Any, dict[str, dict[str, str]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, state, headers = hub
    gate = Gate(monkeypatch)
    many = 34  # more than asyncio's default executor has threads on any machine
    share = state.settings.structured_outputs.compiles_per_caller

    async def scenario() -> None:
        limits = httpx.Limits(max_connections=2 * many)
        async with httpx.AsyncClient(base_url=url, timeout=GUARD_S, limits=limits) as client:

            def post(who: str, body: Any) -> asyncio.Task[httpx.Response]:
                call = client.post("/v1/completions", json=body, headers=headers[who])
                return asyncio.create_task(call)

            greedy = [post("app", choice_body([f"a{i}", "b"])) for i in range(many)]
            # Its share waits in the pool (one compiling); the rest are refused at once.
            while sum(t.done() for t in greedy) < many - share:
                waiting = [t for t in greedy if not t.done()]
                done, _ = await asyncio.wait(
                    waiting, timeout=GUARD_S, return_when="FIRST_COMPLETED"
                )
                assert done, "the caller's compiles over its share were not refused"
            refused = [t for t in greedy if t.done()]
            pending = [t for t in greedy if not t.done()]
            await gate.until_started(1)
            assert len(pending) == share and state.grammar_pool.held("app") == share
            for task in refused:
                r = task.result()
                assert r.status_code == 503 and r.headers["Retry-After"], r.text
                assert "compiles_per_caller" in r.json()["error"]["message"]
            # Another caller's grammar and an unload go ahead while those wait.
            small = await client.post("/v1/completions", json=JSON_OBJECT, headers=headers["other"])
            assert small.status_code == 200, small.text
            unload = await client.post("/admin/models/emb/versions/1/unload", headers=ADMIN)
            assert unload.status_code == 200 and unload.json()["state"] == "unloaded"
            # A caller whose second compile queues behind its first, then leaves.
            first = post("leaver", choice_body(["l1", "x"]))
            await gate.until_started(2)
            with pytest.raises(httpx.ReadTimeout):
                await client.post(
                    "/v1/completions", json=choice_body(["l2", "x"]), headers=headers["leaver"],
                    timeout=httpx.Timeout(GUARD_S, read=1.0),
                )  # fmt: skip
            while state.grammar_pool.held("leaver") > 1:  # noqa: ASYNC110  (no event to await)
                await asyncio.sleep(0.05)
            gate.open()
            for r in await asyncio.gather(first, *pending):
                assert r.status_code == 200, r.text
        assert '["l2", "x"]' not in gate.started

    asyncio.run(scenario())


def test_a_compile_past_its_time_limit_is_a_503_naming_it(
    tmp_path: Path, mlflow_template: Path, tiny_llm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, key = auth_settings(tmp_path, mlflow_template)
    user = {"Authorization": f"Bearer {key}"}
    gate = Gate(monkeypatch)
    with live_hub(settings) as (url, app):
        body = {"name": "tiny", "kind": "llm", "source": str(tiny_llm_dir),
                "config": {"grammar_compile_timeout_ms": 200}}  # fmt: skip
        r = httpx.post(f"{url}/admin/registry/models", json=body, headers=ADMIN, timeout=120)
        assert r.status_code == 201, r.text
        request = choice_body(["yes", "no"])
        r = httpx.post(f"{url}/v1/completions", json=request, headers=user, timeout=GUARD_S)
        assert r.status_code == 503 and r.headers["Retry-After"], r.text
        assert "grammar_compile_timeout_ms" in r.json()["error"]["message"]
        # The compile goes on, holding the caller's share, and once done it is cached.
        gate.open()
        pool = app.state.hub.grammar_pool
        for _ in range(int(GUARD_S / 0.05)):
            if not pool.held("app"):
                break
            time.sleep(0.05)
        r = httpx.post(f"{url}/v1/completions", json=request, headers=user, timeout=GUARD_S)
        assert r.status_code == 200, r.text
