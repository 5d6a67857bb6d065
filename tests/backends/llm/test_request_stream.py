"""A request's stream of deltas on its event loop: every delta handed over is iterated, in
order, before a failure that came after them is raised, and closing it early aborts the
request in the engine."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from backends.llm.async_engine import RequestStream
from backends.llm.engine import RequestOutput
from backends.llm.sequence import FinishReason


class _Owner:
    """The engine side of a stream: records aborts and forgotten requests."""

    def __init__(self) -> None:
        self.engine = self
        self.aborted: list[str] = []
        self.forgotten: list[str] = []

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def wake(self) -> None:
        pass

    def _forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)


def _out(text: str, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput("r", 0, [1], text, [], finish, None, 3, 0, 1)


def _stream(owner: _Owner, n: int = 1) -> RequestStream:
    return RequestStream(owner, "r", n)  # type: ignore[arg-type]


async def _drain(stream: RequestStream) -> list[str]:
    return [out.text async for out in stream]


def test_deltas_handed_over_while_waiting_and_before_come_in_order() -> None:
    async def run() -> tuple[list[str], _Owner]:
        owner = _Owner()
        stream = _stream(owner)
        stream._deliver([_out("a"), _out("b")])  # before anyone waits
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, stream._deliver, [_out("c")])
        loop.call_later(0.02, stream._deliver, [_out("d", FinishReason.LENGTH)])
        return await asyncio.wait_for(_drain(stream), 10), owner

    texts, owner = asyncio.run(run())
    assert texts == ["a", "b", "c", "d"]
    assert owner.forgotten == ["r"] and owner.aborted == []  # finished: nothing to abort


def test_a_failure_is_raised_after_the_deltas_that_came_before_it() -> None:
    async def run() -> tuple[list[str], Any]:
        stream = _stream(_Owner())
        seen: list[str] = []
        stream._deliver([_out("a")])
        stream._deliver(RuntimeError("step failed"))
        stream._deliver(ValueError("a later one"))
        with pytest.raises(RuntimeError, match="step failed"):
            async for out in stream:
                seen.append(out.text)
        return seen, [out async for out in stream]  # closed: nothing more

    seen, after = asyncio.run(run())
    assert seen == ["a"] and after == []


def test_closing_a_waiting_stream_early_aborts_the_request() -> None:
    async def run() -> _Owner:
        owner = _Owner()
        stream = _stream(owner, n=2)

        async def consume() -> None:
            async with stream:
                async for _ in stream:
                    pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)
        stream._deliver([_out("a", FinishReason.LENGTH)])  # one of two samples done
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return owner

    owner = asyncio.run(run())
    assert owner.aborted == ["r"] and owner.forgotten == ["r"]
