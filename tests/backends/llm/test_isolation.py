"""A poison request never fails its neighbours: out-of-range sampling values are refused at
the edge naming the field, an error one sequence causes in a step fails that request alone,
and after an error no request can be blamed for the engine fails the step and serves on."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.base import BackendContext
from backends.errors import InputError
from backends.llm.backend import LLMBackend
from backends.llm.engine import EngineStepError, LLMEngine
from backends.llm.fused.kernel import FusedKernel
from backends.llm.isolation import RequestFailedError
from backends.llm.sampler.plan import StepPlan
from backends.llm.sampling_params import SamplingParams
from backends.llm.sequence import Sequence
from tests.backends.llm.support import build_model, kv_bytes, make_engine, random_prompts

POISON_SEED = 4242


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("isolation-model"), "llama")


@pytest.fixture
def poisoned_sampler(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Sampling a sequence seeded POISON_SEED raises, as a sampling value the validation
    missed would (the overflow `top_k: 2**63` used to cause)."""
    original = StepPlan.build

    def build(seqs: list[Sequence], eos_token_ids: list[int], vocab: int) -> StepPlan:
        if any(s.params.seed == POISON_SEED for s in seqs):
            raise OverflowError("Overflow when unpacking long long")
        return original(seqs, eos_token_ids, vocab)

    monkeypatch.setattr(StepPlan, "build", staticmethod(build))
    yield


def _engine(folder: Path) -> LLMEngine:
    return make_engine(folder, kv_cache_bytes=kv_bytes(folder, 64, 16), block_size=16)


def _run(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, BaseException]]:
    tokens: dict[str, list[int]] = {}
    failed: dict[str, BaseException] = {}
    while engine.has_work():
        try:
            outputs = engine.step()
        except EngineStepError as e:
            for request_id in e.request_ids:
                failed[request_id] = e.errors.get(request_id, e)
            continue
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens, failed


GOOD = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
POISON = SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=12)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": 10**30}, "top_k"),
        ({"n": 2**63}, "n"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
        ({"max_tokens": 10**5000}, "max_tokens"),
        ({"min_tokens": 2**63}, "min_tokens"),
        ({"logprobs": 2**40}, "logprobs"),
        ({"logit_bias": {2**63: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: math.nan}}, "logit_bias"),
        ({"logit_bias": {5: math.inf}}, "logit_bias"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"stop_token_ids": (2**64,)}, "stop_token_ids"),
        ({"top_p": math.nan}, "top_p"),
        ({"min_p": math.inf}, "min_p"),
        ({"presence_penalty": math.nan}, "presence_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(
    params: dict[str, Any], field: str
) -> None:
    with pytest.raises(InputError) as caught:
        SamplingParams(**params).validate()
    assert caught.value.param == field
    assert len(str(caught.value)) < 300  # a 5000-digit number is named, not printed


def test_engine_limits_name_the_field(llama: Path) -> None:
    engine = _engine(llama)
    prompt = [10, 11, 12]
    with pytest.raises(InputError) as caught:
        engine.add_request("a", prompt, GOOD, priority=2**63)
    assert caught.value.param == "priority"
    with pytest.raises(InputError) as caught:
        engine.add_request("b", prompt, SamplingParams(min_tokens=10**6))
    assert caught.value.param == "min_tokens"
    with pytest.raises(InputError) as caught:
        engine.add_request("c", prompt, SamplingParams(logit_bias={10**6: 1.0}))
    assert caught.value.param == "logit_bias"
    # top_k beyond the vocabulary but within the cap means "no cut", and serves.
    engine.add_request("d", prompt, SamplingParams(top_k=2**31 - 1, max_tokens=3, seed=1))
    tokens, failed = _run(engine)
    assert not failed and len(tokens["d"]) == 3


def test_a_request_that_breaks_its_step_fails_alone(llama: Path, poisoned_sampler: None) -> None:
    prompts = random_prompts(8, seed=3, lengths=(5, 40))
    clean = _engine(llama)
    for i, prompt in enumerate(prompts):
        clean.add_request(f"good{i}", prompt, GOOD)
    expected, failed = _run(clean)
    assert not failed

    engine = _engine(llama)
    for i, prompt in enumerate(prompts[:4]):
        engine.add_request(f"good{i}", prompt, GOOD)
    engine.add_request("poison", [20, 21, 22, 23], POISON)
    for i, prompt in enumerate(prompts[4:], start=4):
        engine.add_request(f"good{i}", prompt, GOOD)
    tokens, failed = _run(engine)

    assert list(failed) == ["poison"]
    assert isinstance(failed["poison"], RequestFailedError)
    assert isinstance(failed["poison"], InputError)  # the caller's 400, not the hub's 500
    assert "Overflow" in str(failed["poison"])
    # Every neighbour finished, with the very tokens it gets without the poison around.
    assert tokens == expected
    assert engine.kv_cache.pool.num_used_blocks == 0


@pytest.mark.parametrize("path", ["transformers", "fused"])
def test_an_error_nobody_can_be_blamed_for_fails_the_step_and_the_engine_serves_on(
    llama: Path, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(llama)
    broken = {"left": 1}
    if path == "fused":  # the step's forward is the fused kernel's call
        assert engine.runner.fused.decoder is not None
        forward = FusedKernel.step

        def flaky_call(*args: Any, **kwargs: Any) -> Any:
            if broken["left"]:
                broken["left"] -= 1
                raise RuntimeError("device lost")
            return forward(*args, **kwargs)

        monkeypatch.setattr(FusedKernel, "step", flaky_call)
    else:
        engine.runner.fused.forget()  # and never rebuilt: every step runs in transformers
        monkeypatch.setattr(engine.runner.fused, "decoder_for", lambda *a: None)
        model = engine.runner.model
        model_forward = model.forward

        def flaky(*args: Any, **kwargs: Any) -> Any:
            if broken["left"]:
                broken["left"] -= 1
                raise RuntimeError("device lost")
            return model_forward(*args, **kwargs)

        model.forward = flaky
    prompts = random_prompts(4, seed=5, lengths=(5, 20))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"first{i}", prompt, GOOD)
    tokens, failed = _run(engine)
    assert sorted(failed) == [f"first{i}" for i in range(4)] and not tokens
    assert all(isinstance(e, EngineStepError) for e in failed.values())
    assert engine.kv_cache.pool.num_used_blocks == 0

    for i, prompt in enumerate(prompts):
        engine.add_request(f"next{i}", prompt, GOOD)
    tokens, failed = _run(engine)
    assert not failed
    assert sorted(tokens) == [f"next{i}" for i in range(4)]
    assert all(len(t) == GOOD.max_tokens for t in tokens.values())


async def test_over_the_async_engine_the_poison_stream_fails_and_the_others_finish(
    llama: Path, poisoned_sampler: None
) -> None:
    backend = LLMBackend(BackendContext("tiny", "1", {"kv_cache_bytes": 2 * 2**20}))
    backend.load(llama, "cpu", torch.float32)
    try:

        async def collect(prompt: list[int], params: SamplingParams) -> list[int]:
            out: list[int] = []
            async for delta in backend.generate(prompt, params):
                out += delta.token_ids
            return out

        prompts = random_prompts(8, seed=7, lengths=(5, 30))
        jobs = [collect(p, GOOD) for p in prompts[:4]]
        jobs.append(collect([30, 31, 32], POISON))
        jobs += [collect(p, GOOD) for p in prompts[4:]]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        assert isinstance(results[4], RequestFailedError)
        good = results[:4] + results[5:]
        assert all(isinstance(r, list) and len(r) == GOOD.max_tokens for r in good), good
    finally:
        await backend.aclose()
        backend.unload()
