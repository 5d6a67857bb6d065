"""The LLM backend's lifecycle and the async engine: memory predicted and measured, offload
and restore, unload, refusal of unverified architectures, aborts that free blocks at once."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from backends.base import BackendContext
from backends.errors import BackendClosedError, InputError, LoadError
from backends.kinds import backend_class
from backends.llm.backend import INLINE_TOKENIZE_BYTES, LLMBackend
from backends.llm.engine import RequestOutput
from backends.llm.sampling_params import SamplingParams
from backends.loading import module_bytes
from tests.backends.llm.support import build_model

KV = 2 * 2**20


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("backend-model"), "llama")


def loaded(folder: Path, **config: object) -> LLMBackend:
    backend = LLMBackend(BackendContext("tiny", "1", {"kv_cache_bytes": KV, **config}))
    backend.load(folder, "cpu", torch.float32)
    return backend


def test_kind_llm_is_served_by_the_llm_backend() -> None:
    assert backend_class("llm") is LLMBackend


def test_predicted_memory_covers_weights_and_the_kv_reservation(llama: Path) -> None:
    predicted = LLMBackend.predict_memory(llama, {"kv_cache_bytes": "2MiB"})
    backend = loaded(llama)
    try:
        measured = backend.memory_bytes()
        runner = backend.engine.runner
        weights = module_bytes(runner.model)
        scratch = runner.fused.scratch_bytes  # the fused CPU step's (test_fused.py)
        # Whole blocks of the reservation.
        assert KV - 64 * 1024 < measured - weights - scratch <= KV
        assert measured <= predicted < measured + 128 * 2**20
    finally:
        backend.unload()
    bigger = LLMBackend.predict_memory(llama, {"kv_cache_bytes": "66MiB"})
    assert bigger - predicted == 64 * 2**20
    fraction = LLMBackend.predict_memory(
        llama, {"kv_cache_fraction": 0.25}, device_budget_bytes=400 * 2**20
    )
    assert fraction - predicted == 100 * 2**20 - KV
    with pytest.raises(LoadError, match="device budget"):
        LLMBackend.predict_memory(llama, {"kv_cache_fraction": 0.25})
    with pytest.raises(LoadError, match="kv_cache_bytes"):
        LLMBackend.predict_memory(llama, {"kv_cache_bytes": "lots"})


def test_an_unverified_architecture_is_refused_listing_the_supported(
    llama: Path, tmp_path: Path
) -> None:
    folder = shutil.copytree(llama, tmp_path / "gpt2ish")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (folder / "config.json").write_text(json.dumps(config))
    backend = LLMBackend(BackendContext("odd", "1", {}))
    with pytest.raises(LoadError) as info:
        backend.load(folder, "cpu")
    message = str(info.value)
    assert "gpt_neox" in message
    assert all(a in message for a in ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2"))


def test_bad_runtime_config_is_refused_naming_the_key(llama: Path) -> None:
    with pytest.raises(LoadError, match="block_size"):
        loaded(llama, block_size=0)


async def test_offload_restore_and_unload(llama: Path) -> None:
    backend = loaded(llama)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    prompt = backend.encode("The harbour town")

    async def text() -> str:
        return "".join([out.text async for out in backend.generate(prompt, params)])

    before = await text()
    full = backend.memory_bytes()
    backend.offload()
    assert backend.device == "cpu" and backend.memory_bytes() < full  # the KV cache is gone
    with pytest.raises(BackendClosedError, match="offloaded"):
        backend.submit(prompt, params)
    backend.restore("cpu")
    # Restored weights live in one block, each tensor aligned to 256 bytes: a little padding.
    assert 0 <= backend.memory_bytes() - full < 64 * 1024
    assert await text() == before
    await backend.aclose()
    backend.unload()
    assert backend.device is None and backend.memory_bytes() == 0
    with pytest.raises(BackendClosedError):
        backend.submit(prompt, params)


@pytest.mark.parametrize("fused_step", [True, False])  # the fused step, the torch modules
async def test_a_restore_keeps_the_engine_and_gives_the_same_greedy_tokens(
    llama: Path, monkeypatch: pytest.MonkeyPatch, fused_step: bool
) -> None:
    """A restore brings the weights back and a new KV cache, nothing else: the engine, its
    scheduler and block pool, the tokenizer and the sampler are the objects from the load
    (no tokenizer is read again), and greedy tokens are the same. The new cache is filled
    with NaN before generating: no step reads a slot it did not write (a cached prefix from
    before the offload included), so whatever an uninitialised cache holds cannot leak."""
    import transformers

    backend = loaded(llama, fused_step=fused_step)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # The second prompt shares the first's opening blocks: a prefix-cache hit before.
    prompts = [backend.encode("The harbour town woke slowly " * 4), backend.encode("Ships")]
    prompts.append(prompts[0] + backend.encode(" and the bells rang"))

    async def tokens() -> list[list[int]]:
        outs = []
        for prompt in prompts:
            outs.append(
                [t async for out in backend.generate(prompt, params) for t in out.token_ids]
            )
        return outs

    reads: list[object] = []
    from_pretrained = transformers.AutoTokenizer.from_pretrained

    def counted(*args: object, **kwargs: object) -> object:
        reads.append(args)
        return from_pretrained(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    try:
        before = await tokens()
        engine = backend.engine
        kept = (engine, engine.scheduler, engine.kv_cache, engine.kv_cache.pool,
                engine.runner, engine.runner.sampler, backend.tokenizer)  # fmt: skip
        for _ in range(2):
            backend.offload()
            backend.restore("cpu")
            for kv in engine.runner.kv_caches:
                kv.fill_(float("nan"))
            assert await tokens() == before
        engine = backend.engine
        now = (engine, engine.scheduler, engine.kv_cache, engine.kv_cache.pool,
               engine.runner, engine.runner.sampler, backend.tokenizer)  # fmt: skip
        assert all(a is b for a, b in zip(kept, now, strict=True))
        assert reads == []  # the tokenizer was not loaded again
    finally:
        await backend.aclose()
        backend.unload()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_a_restore_on_cuda_copies_the_pinned_weights_back_with_the_same_tokens(
    llama: Path,
) -> None:
    """On a GPU the weights park in pinned host memory and come back in one copy; the
    engine is kept, the graphs are captured again as steps need them, and greedy tokens
    (decode steps on the graph path where Triton runs) are the same, with the new cache
    filled with NaN where it is left uninitialised."""
    backend = LLMBackend(BackendContext("tiny", "1", {"kv_cache_bytes": KV}))
    backend.load(llama, "cuda:0", torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [backend.encode("The harbour town woke slowly " * 4), backend.encode("Ships")]

    async def tokens() -> list[list[int]]:
        outs = []
        for prompt in prompts:
            outs.append(
                [t async for out in backend.generate(prompt, params) for t in out.token_ids]
            )
        return outs

    try:
        before = await tokens()
        engine, runner = backend.engine, backend.engine.runner
        weights = module_bytes(runner.model)
        backend.offload()
        parked = backend._parked
        assert parked is not None and parked.pinned and parked.nbytes >= weights
        backend.restore("cuda:0")
        if not runner._reads_past_lengths():
            for kv in runner.kv_caches:
                kv.fill_(float("nan"))
        assert await tokens() == before
        assert backend.engine is engine and engine.runner is runner
    finally:
        await backend.aclose()
        backend.unload()


def test_a_cache_the_padded_decode_may_read_starts_zeroed(llama: Path) -> None:
    """The padded decode call (accelerators without the Triton kernel; here forced on the
    CPU) reads every slot of a row's table under a mask, where NaN would still spread: its
    cache starts as zeros. Elsewhere the cache is left uninitialised (the test above)."""
    from backends.llm.config import EngineConfig
    from backends.llm.model_runner import ModelRunner

    config = EngineConfig(kv_cache_bytes=KV)
    runner = ModelRunner.load(llama, "cpu", torch.float32, config, batched_decode=True)
    for kv in runner.kv_caches:
        kv.fill_(float("nan"))
    runner.release_kv_cache()
    runner.allocate_kv_cache()
    assert all(bool((kv == 0).all()) for kv in runner.kv_caches)


async def test_bad_requests_fail_before_anything_is_queued(llama: Path) -> None:
    backend = loaded(llama, max_model_len=32)
    try:
        with pytest.raises(InputError, match="32"):
            backend.submit(list(range(10, 40)), SamplingParams(max_tokens=8))
        with pytest.raises(InputError, match="empty"):
            backend.submit([], SamplingParams())
        assert not backend.engine.has_work()
    finally:
        await backend.aclose()
        backend.unload()


async def test_an_abandoned_or_cancelled_request_frees_its_blocks_at_once(llama: Path) -> None:
    backend = loaded(llama)
    engine = backend.engine
    long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    prompt = backend.encode("The harbour town woke slowly on winter mornings.")
    try:
        # Leaving the loop early (a client gone) aborts the request.
        count = 0
        async for _ in backend.generate(prompt, long):
            count += 1
            if count == 3:
                break
        await _wait_idle(backend)

        # A task cancelled mid-stream (a timeout) does too: cancelled once it has tokens,
        # so the test does not depend on how fast the engine makes 1,500 of them.
        streaming = asyncio.Event()

        async def consume() -> None:
            async for _ in backend.generate(prompt, long):
                streaming.set()

        task = asyncio.create_task(consume())
        await streaming.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_idle(backend)
        assert engine.scheduler.num_steps < 1500, "the requests ran to the end"
    finally:
        await backend.aclose()
        backend.unload()


async def _wait_idle(backend: LLMBackend) -> None:
    for _ in range(200):
        if not backend.engine.has_work() and backend.engine.kv_cache.pool.num_used_blocks == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the aborted request still holds KV blocks")


async def test_a_step_s_tokens_are_streamed_while_the_next_step_computes(llama: Path) -> None:
    """A step's outputs reach the stream as the next step's forward starts (streaming them
    overlaps that forward), and at once when no step follows."""
    backend = loaded(llama)
    runner = backend.engine.runner
    handover = runner.before_forward
    assert handover is not None
    held, release = threading.Event(), threading.Event()
    forwards = 0

    def hold_the_third_forward() -> None:
        nonlocal forwards
        handover()
        forwards += 1
        if forwards == 3:
            held.set()
            release.wait(30)

    runner.before_forward = hold_the_third_forward
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    got: list[RequestOutput] = []

    async def consume() -> None:
        async for out in backend.generate(backend.encode("The harbour town"), params):
            got.append(out)

    task = asyncio.create_task(consume())
    try:
        assert await asyncio.to_thread(held.wait, 30)
        # The prefill's token and the first decode's, while the second decode is held.
        for _ in range(500):
            if len(got) == 2:
                break
            await asyncio.sleep(0.01)
        assert [len(out.token_ids) for out in got] == [1, 1]
        release.set()
        await asyncio.wait_for(task, 30)
        assert len(got) == 5 and got[-1].finished  # the last step's, with no step after it
    finally:
        release.set()
        await backend.aclose()
        backend.unload()


async def test_a_small_request_is_tokenized_on_the_loop_a_long_one_off_it_same_ids(
    llama: Path,
) -> None:
    backend = loaded(llama)
    short = "The harbour town woke slowly."
    long = " ".join(["The harbour town woke slowly on winter mornings."] * 40)
    assert len(short) < INLINE_TOKENIZE_BYTES < len(long)
    ran_on: list[threading.Thread] = []

    def build(text: str) -> tuple[list[int], list[int]]:
        ran_on.append(threading.current_thread())
        return backend.encode(text), backend.encode_chat([{"role": "user", "content": text}])

    try:
        for text in (short, long):
            tokenize = functools.partial(build, text)
            by_size = await backend.tokenize(tokenize, size=len(text.encode()))
            unknown = await backend.tokenize(tokenize, size=None)
            assert by_size == unknown
            assert by_size[0] == backend.tokenizer.encode(text)
        loop = threading.current_thread()
        # Only the small request with its size known ran on the event loop.
        assert [thread is loop for thread in ran_on] == [True, False, False, False]
    finally:
        await backend.aclose()
        backend.unload()


def test_engine_settings_are_checked_at_load(llama: Path) -> None:
    with pytest.raises(LoadError, match="max_num_batched_tokens"):
        loaded(llama, max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(LoadError, match="either kv_cache_bytes or kv_cache_fraction"):
        LLMBackend.predict_memory(llama, {"kv_cache_bytes": 10**6, "kv_cache_fraction": 0.1})
