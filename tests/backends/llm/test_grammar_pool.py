"""The grammar pool and size limits: one caller's compiles never hold every thread, a caller
over its share is refused at once, a compile nobody waits for never starts, the time limit
and the size limits are errors naming themselves. Compiles here are functions that wait on
events, so every ordering is decided by the test, not by timing."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from backends.errors import CapacityError, InputError
from backends.llm.structured import StructuredOutput
from backends.llm.structured.limits import GrammarLimits
from backends.llm.structured.pool import CompilePool

# Bound on any wait for a thread in these tests: a hang guard, never reached when they pass.
GUARD_S = 30.0


class Gate:
    """A compile that records that it started, then waits until the test opens it."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._open = threading.Event()
        self._cond = threading.Condition()

    def compile(self, name: str) -> Callable[[], str]:
        def run() -> str:
            with self._cond:
                self.started.append(name)
                self._cond.notify_all()
            assert self._open.wait(GUARD_S), "the test never opened the gate"
            return name

        return run

    def open(self) -> None:
        self._open.set()

    async def until_started(self, *names: str) -> None:
        def wait() -> bool:
            with self._cond:
                return self._cond.wait_for(lambda: set(names) <= set(self.started), GUARD_S)

        assert await asyncio.to_thread(wait), f"{names} never started; {self.started} did"


def test_a_caller_holds_one_thread_and_its_share_while_others_get_the_rest() -> None:
    async def scenario() -> None:
        pool = CompilePool(threads=2, per_caller=3)
        gate = Gate()
        greedy = [
            asyncio.create_task(pool.run(f"a{i}", gate.compile(f"a{i}"), caller="a", limit_s=None))
            for i in range(3)
        ]
        await gate.until_started("a0")
        # Its fourth is refused at once, naming the setting; its second and third wait.
        with pytest.raises(CapacityError, match="compiles_per_caller") as refused:
            await pool.run("a3", gate.compile("a3"), caller="a", limit_s=None)
        assert refused.value.retry_after > 0
        assert pool.held("a") == 3 and pool.queued() == 2
        # Another caller's compile takes the second thread while "a"'s wait.
        other = asyncio.create_task(pool.run("b0", gate.compile("b0"), caller="b", limit_s=None))
        await gate.until_started("b0")
        assert gate.started == ["a0", "b0"]
        gate.open()
        assert await asyncio.gather(*greedy, other) == ["a0", "a1", "a2", "b0"]
        assert pool.held("a") == 0
        pool.close()

    asyncio.run(scenario())


def test_equal_compiles_run_once_and_a_queued_one_nobody_awaits_never_starts() -> None:
    async def scenario() -> None:
        pool = CompilePool(threads=1, per_caller=4)
        gate = Gate()
        first = asyncio.create_task(pool.run("x", gate.compile("x"), caller="a", limit_s=None))
        again = asyncio.create_task(pool.run("x", gate.compile("x2"), caller="b", limit_s=None))
        await gate.until_started("x")
        queued = asyncio.create_task(pool.run("y", gate.compile("y"), caller="b", limit_s=None))
        while pool.queued() == 0:  # noqa: ASYNC110  (the task enqueues at its first step)
            await asyncio.sleep(0)
        queued.cancel()  # its client left
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert pool.queued() == 0 and pool.held("b") == 0
        gate.open()
        assert await asyncio.gather(first, again) == ["x", "x"]
        # Another compile after the cancelled one runs, and "y" never did.
        assert await pool.run("z", lambda: "z", caller="b", limit_s=None) == "z"
        assert gate.started == ["x"]
        pool.close()

    asyncio.run(scenario())


def test_a_compile_past_its_time_limit_is_a_503_naming_it_and_keeps_its_slot() -> None:
    async def scenario() -> None:
        pool = CompilePool(threads=1, per_caller=1)
        gate = Gate()
        with pytest.raises(CapacityError, match="grammar_compile_timeout_ms") as late:
            await pool.run("slow", gate.compile("slow"), caller="a", limit_s=0.05)
        assert late.value.retry_after >= 1
        # The thread cannot be stopped: until it returns, it counts against its caller.
        with pytest.raises(CapacityError, match="compiles_per_caller"):
            await pool.run("next", lambda: "next", caller="a", limit_s=None)
        gate.open()
        while pool.held("a"):  # noqa: ASYNC110  (the thread returns once the gate opens)
            await asyncio.sleep(0.01)
        assert await pool.run("next", lambda: "next", caller="a", limit_s=None) == "next"
        pool.close()

    asyncio.run(scenario())


def test_constraints_over_a_limit_are_input_errors_naming_it() -> None:
    limits = GrammarLimits(max_grammar_bytes=100, max_choices=10, max_choice_bytes=50)
    limits.check(StructuredOutput.choice([f"c{i}" for i in range(10)]))
    limits.check(StructuredOutput.regex("a" * 100))
    cases = {
        "max_choices": StructuredOutput.choice([f"c{i}" for i in range(11)]),
        "max_choice_bytes": StructuredOutput.choice(["é" * 26]),
        "max_choices, max_choice_bytes": StructuredOutput.choice(["x" * 10] * 10_000),
        "max_grammar_bytes": StructuredOutput.regex("a" * 101),
    }
    for key, spec in cases.items():
        with pytest.raises(InputError, match=f"runtime config {key}") as info:
            limits.check(spec)
        assert info.value.param == "structured_outputs"
    schema = StructuredOutput.json_schema({"enum": ["v" * 100]})
    with pytest.raises(InputError, match="max_grammar_bytes") as info:
        limits.check(schema)
    assert info.value.param == "response_format"
