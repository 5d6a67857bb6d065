"""One HTTP request's text generation, from acquiring the model to its last token.

`start_generation` enters `Serving.serve(...)` (so the manager counts the request in flight
and never evicts the model under it), builds the prompts and submits them. Errors up to that point
(a bad prompt, a context overflow) propagate before any byte of a response is sent, so they
become proper 4xx answers. The returned `Generation` then yields the engine's deltas; closing
it (the response finished, the client went away, a task was cancelled) aborts whatever is
still running, which frees its KV blocks, and only then releases the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import TracebackType

from starlette.requests import Request

from backends.errors import InputError
from backends.llm.async_engine import RequestStream
from backends.llm.backend import LLMBackend
from backends.llm.engine import RequestOutput
from backends.llm.sampling_params import SamplingParams
from backends.llm.sequence import Logprob
from hub.api.bodies import cancelled_if_client_leaves
from hub.api.serving import LLM, Serving
from hub.api.structured import caller_of
from hub.routing import Route
from hub.traffic.replays import GenerationReplay
from hub.traffic.request import ServedRequest
from registry.usage import UsageCounts

# What a route makes of the backend: the prompts (token ids), their sampling parameters.
PromptBuilder = Callable[[LLMBackend], tuple[list[list[int]], SamplingParams]]
# What the LLM backend calls a prompt in its errors, whatever field of the request it came from.
_BACKEND_PROMPT_PARAMS = ("prompt", "messages")


@dataclass
class Choice:
    """Everything generated for one choice (prompt i, sample j) so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason.value
            self.stop_reason = out.stop_reason


@dataclass
class Generation:
    """The engine requests of one HTTP request (one per prompt) and the model they hold."""

    backend: LLMBackend
    route: Route
    prompts: list[list[int]]
    params: SamplingParams
    streams: list[RequestStream]
    _exit: contextlib.AsyncExitStack
    # The traffic layer's handle on this request (tokens for the readout, shadow mirroring);
    # kept here because a stream finishes in another task than the one that started it.
    served: ServedRequest | None = None
    # What this request is metered for (hub.usage); its tokens are added when it closes.
    usage: UsageCounts | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    cached_tokens: int = 0
    completion_tokens: int = 0
    _closed: bool = False
    # Each choice's text, kept only when the request is mirrored to a shadow version.
    _texts: dict[int, str] | None = None
    _finished: set[int] = field(default_factory=set)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def choice_index(self, prompt: int, out: RequestOutput) -> int:
        return prompt * self.params.n + out.index

    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, delta) as the engine produces them, all prompts interleaved."""
        if self.served is not None and self.served.shadow is not None:
            self._texts = {}
        if len(self.streams) == 1:  # the common case, without the merge's tasks and queue
            async for out in self.streams[0]:
                yield self._count(0, out), out
            return
        async for prompt, out in _merge(self.streams):
            yield self._count(prompt, out), out

    def _count(self, prompt: int, out: RequestOutput) -> int:
        """Account for one delta of prompt `prompt`'s request; its choice index."""
        self.completion_tokens += len(out.token_ids)
        if out.index == 0 and out.num_output_tokens == len(out.token_ids):
            self.cached_tokens += out.num_cached_tokens
        index = self.choice_index(prompt, out)
        if self._texts is not None:
            self._texts[index] = self._texts.get(index, "") + out.text
        if out.finish_reason is not None:
            self._finished.add(index)
        return index

    async def collect(self) -> list[Choice]:
        choices = [Choice(i) for i in range(len(self.prompts) * self.params.n)]
        async for index, out in self.deltas():
            choices[index].add(out)
        return choices

    async def answer(self, request: Request) -> list[Choice]:
        """Every choice in full, for a non-streamed answer; then the model is released. A
        client that disconnects meanwhile raises ClientGone, and its engine requests are
        aborted at once (freeing their KV blocks) rather than generated to the end."""
        async with cancelled_if_client_leaves(request), self:
            return await self.collect()

    async def close(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None:
        """Abort unfinished requests (freeing their blocks), then release the model."""
        if self._closed:
            return
        self._closed = True
        for stream in self.streams:
            stream.abort()
        self._report(complete=exc is None)
        await self._exit.__aexit__(exc_type, exc, tb)

    def _report(self, *, complete: bool) -> None:
        """Hand the traffic layer the generated token count and, for a finished greedy
        request selected for shadowing, the texts to compare the shadow's with; and the
        tokens the answer's `usage` reports to the meter."""
        if self.usage is not None:
            self.usage.prompt_tokens += self.prompt_tokens
            self.usage.completion_tokens += self.completion_tokens
        served = self.served
        if served is None or served.finished:
            return
        served.tokens += self.completion_tokens
        choices = len(self.prompts) * self.params.n
        if (
            served.shadow is not None
            and self._texts is not None
            and complete
            and len(self._finished) == choices
            and self.params.greedy
        ):
            served.replay = GenerationReplay(self.prompts, self.params)
            served.output = [self._texts.get(i, "") for i in range(choices)]

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close(exc_type, exc, tb)


async def start_generation(
    serving: Serving,
    route: Route,
    endpoint: str,
    build: PromptBuilder,
    *,
    priority: int = 0,
    keep_alive: float | None = None,
    prompt_param: str = "prompt",
    request: Request | None = None,
) -> Generation:
    """Acquire the model and submit the request's prompts; raises before anything streams.
    `prompt_param`: the request field the prompts were made from (`messages` for a chat);
    an InputError about the prompt names it, as the caller sent it. `request`: whose caller
    a grammar compile counts against, and which compile is dropped if its client leaves."""
    stack = contextlib.AsyncExitStack()
    req = await stack.enter_async_context(
        serving.serve(route, endpoint, LLM, keep_alive=keep_alive)
    )
    backend = req.backend
    streams: list[RequestStream] = []
    try:
        # A small request is tokenized on the event loop, a long one on the model's
        # tokenizer thread (LLMBackend.tokenize); a grammar compiles on the grammar pool
        # (its own threads), given up if the client leaves.
        size = _body_size(request)
        prompts, params = await backend.tokenize(lambda: build(backend), size=size)
        if params.structured is not None and request is not None:
            caller = caller_of(request)
            async with cancelled_if_client_leaves(request):
                await backend.compile_grammar(params, caller=caller)
        else:
            await backend.compile_grammar(params)
        for prompt in prompts:
            streams.append(backend.submit(prompt, params, priority=priority))
    except BaseException as e:
        for stream in streams:
            stream.abort()
        if isinstance(e, InputError) and e.param in _BACKEND_PROMPT_PARAMS:
            e.param = prompt_param
        await stack.__aexit__(type(e), e, e.__traceback__)
        raise
    return Generation(
        backend, route, prompts, params, streams, stack, served=req.served, usage=req.usage
    )


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def _body_size(request: Request | None) -> int | None:
    """The request body's size in bytes from its `Content-Length` (None: not sent)."""
    length = request.headers.get("content-length") if request is not None else None
    return int(length) if length is not None and length.isdigit() else None
