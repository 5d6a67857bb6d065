"""Asynchronous steps (`async_steps`): a greedy decode step is launched before the previous
one's tokens land, its in-flight inputs fed on the device. The static decode step runs
eagerly on the CPU here, which is the code a GPU replays: what a client sees must not change
(tokens, finish reasons, stop strings, aborts, preemption, prefix-cache hits), and steps must
really be launched ahead."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from backends.llm.engine import LLMEngine
from backends.llm.sampling_params import SamplingParams
from backends.llm.sequence import FinishReason
from tests.backends.llm.support import build_model, kv_bytes, random_prompts, run_all
from tests.backends.llm.test_decode_graphs import BLOCK_SIZE
from tests.backends.llm.test_decode_graphs import engine as static_engine


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("async-steps"), "llama")


def engine(folder: Path, asynchronous: bool, **config: Any) -> LLMEngine:
    """The static decode step run eagerly (`test_decode_graphs.engine`), launched ahead or
    not."""
    settings: dict[str, Any] = {
        "max_num_seqs": 8,
        "kv_cache_bytes": kv_bytes(folder, 200, BLOCK_SIZE),
        "async_steps": asynchronous,
        **config,
    }
    return static_engine(folder, True, **settings)


def count_launches(eng: LLMEngine) -> list[int]:
    """A counter (one element) of the steps `eng` launches ahead."""
    launched = [0]
    original = eng.launcher.launch

    def counting(*args: Any) -> Any:
        launched[0] += 1
        return original(*args)

    eng.launcher.launch = counting  # type: ignore[method-assign]
    return launched


def outcomes(results: list[list[Any]]) -> list[tuple[list[int], Any]]:
    return [(c.token_ids, c.finish_reason) for samples in results for c in samples]


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def test_greedy_tokens_are_the_same_and_steps_launch_ahead(folder: Path) -> None:
    prompts = random_prompts(6, seed=3, lengths=(3, 30))
    lengths = [1, 5, 9, 17, 30, 40]
    requests = [(p, greedy(m, ignore_eos=True)) for p, m in zip(prompts, lengths, strict=True)]
    sync = outcomes(run_all(engine(folder, False), requests))
    eng = engine(folder, True)
    launched = count_launches(eng)
    assert outcomes(run_all(eng, requests)) == sync
    assert launched[0] > 30  # decode steps went ahead (prefills are synchronous)
    assert not eng.has_work() and eng._inflight is None
    assert all(not seq.block_ids for seq in eng.scheduler.running)


def test_stops_end_where_synchronous_steps_end_them(folder: Path) -> None:
    """An EOS, a stop token or a stop string that lands while the next step is already in
    flight ends the sequence at the same token; the extra row computed for it is dropped."""
    prompts = random_prompts(5, seed=11, lengths=(4, 20))
    base = run_all(engine(folder, False), [(p, greedy(20, ignore_eos=True)) for p in prompts])
    requests = []
    for p, samples in zip(prompts, base, strict=True):
        produced = samples[0].token_ids
        requests.append((p, greedy(20, stop_token_ids=[produced[6]])))  # ends at its 1st use
    sync = outcomes(run_all(engine(folder, False), requests))
    assert any(reason is FinishReason.STOP for _, reason in sync)
    assert outcomes(run_all(engine(folder, True), requests)) == sync


def test_preemption_and_prefix_hits_keep_the_tokens(folder: Path) -> None:
    """A pool too small for every sequence preempts some mid-flight; shared prefixes hit the
    prefix cache, whose blocks are registered only once their last token has landed."""
    rng = random.Random(5)
    shared = [rng.randrange(3, 400) for _ in range(13)]
    prompts = [shared + [rng.randrange(3, 400) for _ in range(rng.randint(1, 6))] for _ in range(6)]
    requests = [(p, greedy(24, ignore_eos=True)) for p in prompts]
    small = {"kv_cache_bytes": kv_bytes(folder, 40, BLOCK_SIZE)}
    sync_engine, async_engine = engine(folder, False, **small), engine(folder, True, **small)
    sync = outcomes(run_all(sync_engine, requests))
    assert outcomes(run_all(async_engine, requests)) == sync
    assert async_engine.scheduler.num_preemptions > 0
    again = outcomes(run_all(async_engine, requests))  # prefixes now cached
    assert again == sync
    assert async_engine.kv_cache.prefix_hits > 0


def test_an_abort_mid_flight_frees_everything(folder: Path) -> None:
    eng = engine(folder, True)
    for i, p in enumerate(random_prompts(3, seed=2, lengths=(5, 9))):
        eng.add_request(str(i), p, greedy(40, ignore_eos=True))
    for _ in range(6):
        eng.step()
    assert eng._inflight is not None
    eng.abort_request("1")
    finished: dict[str, Any] = {}
    while eng.has_work():
        for out in eng.step():
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
    assert finished.get("0") is FinishReason.LENGTH and finished.get("2") is FinishReason.LENGTH
    assert eng.kv_cache.usage == 0.0


def test_arrivals_between_steps_get_the_same_tokens(folder: Path) -> None:
    """Requests that arrive while steps are in flight land the step first and start
    synchronously; the decodes then go ahead again."""
    prompts = random_prompts(4, seed=9, lengths=(3, 25))
    params = greedy(12, ignore_eos=True)

    def staggered(eng: LLMEngine) -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {}
        pending = list(enumerate(prompts))
        while pending or eng.has_work():
            if pending:
                i, p = pending.pop(0)
                eng.add_request(str(i), p, params)
            for out in eng.step():
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
        return tokens

    assert staggered(engine(folder, True)) == staggered(engine(folder, False))


def test_sampled_and_logprob_requests_take_synchronous_steps(folder: Path) -> None:
    prompts = random_prompts(3, seed=4, lengths=(4, 12))
    requests = [
        (prompts[0], greedy(10, ignore_eos=True, logprobs=2)),
        (prompts[1], SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)),
        (prompts[2], greedy(10, ignore_eos=True)),
    ]
    eng = engine(folder, True)
    launched = count_launches(eng)
    results = run_all(eng, requests)
    sync = run_all(engine(folder, False), requests)
    assert outcomes(results) == outcomes(sync)
    assert [c.logprobs for c in results[0]] == [c.logprobs for c in sync[0]]
    assert launched[0] == 0  # a logprobs or sampled row keeps every step synchronous


async def test_streams_through_the_engine_thread_get_the_same_tokens(folder: Path) -> None:
    """The engine thread (`AsyncLLMEngine`) with steps launched ahead: every stream gets the
    tokens a synchronous engine gives, and ends."""
    import asyncio

    from backends.llm.async_engine import AsyncLLMEngine

    prompts = random_prompts(4, seed=21, lengths=(3, 20))
    params = greedy(16, ignore_eos=True)
    sync = outcomes(run_all(engine(folder, False), [(p, params) for p in prompts]))
    eng = engine(folder, True)
    launched = count_launches(eng)
    threaded = AsyncLLMEngine(eng)
    try:

        async def one(prompt: list[int]) -> tuple[list[int], Any]:
            tokens: list[int] = []
            reason = None
            async for out in threaded.generate(prompt, params):
                tokens.extend(out.token_ids)
                reason = out.finish_reason
            return tokens, reason

        got = await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 60)
    finally:
        threaded.shutdown()
    assert list(got) == sync
    assert launched[0] > 0


@pytest.mark.parametrize("where", ["launch", "collect"])
@pytest.mark.parametrize("n", [1, 2])
def test_a_device_failure_mid_flight_is_the_servers_not_a_requests(
    folder: Path, where: str, n: int
) -> None:
    """A step launched ahead that fails at its launch or its landing fails every request as
    a server error (no request is blamed: its inputs were checked on arrival), and the
    engine serves the next request."""
    from backends.llm.outputs import EngineStepError

    eng = engine(folder, True)
    [prompt] = random_prompts(1, seed=1, lengths=(6, 6))
    eng.add_request("0", prompt, greedy(30, ignore_eos=True, n=n))
    for _ in range(5):
        eng.step()
    assert eng.in_flight
    original = getattr(eng.launcher, where)

    def device_lost(*args: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    setattr(eng.launcher, where, device_lost)
    with pytest.raises(EngineStepError) as failure:
        while eng.has_work():
            eng.step()
    assert failure.value.request_ids == ["0"] and not failure.value.errors
    assert not eng.in_flight and not eng.has_work() and eng.kv_cache.usage == 0.0
    setattr(eng.launcher, where, original)
    results = run_all(eng, [(prompt, greedy(6, ignore_eos=True))])
    assert outcomes(results) == outcomes(
        run_all(engine(folder, False), [(prompt, greedy(6, ignore_eos=True))])
    )
