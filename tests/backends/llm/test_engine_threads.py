"""The LLM step thread's torch threads: under `hub serve` every thread starts at one torch
thread (so only compute threads own OpenMP teams, backends/threads.py), a CPU model's step
thread still runs its steps on the compute threads, and greedy output stays the same
from one run to the next (it did not while the step thread set its own count)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends import threads as threads_module
from backends.base import BackendContext
from backends.llm.backend import LLMBackend
from backends.llm.context import LLMContext
from backends.llm.engine import LLMEngine, RequestOutput
from backends.llm.kernel_settings import KernelSettings
from backends.llm.sampling_params import SamplingParams
from backends.threads import only_compute_threads, start_up_count
from tests.backends.llm.support import build_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("threads-model"), "llama")


async def test_steps_run_on_every_core_while_other_threads_start_at_one(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = torch.get_num_threads()
    seen: list[int] = []
    original = LLMEngine.step

    def step(self: LLMEngine) -> list[RequestOutput]:
        seen.append(torch.get_num_threads())
        return original(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    monkeypatch.setattr(threads_module, "_compute", None)  # restored after the test
    only_compute_threads(2)  # as `hub serve` does first (there: torch's own count)
    try:
        backend = LLMBackend(BackendContext("tiny", "1", {"kv_cache_bytes": 2 * 2**20}))
        backend.load(llama, "cpu", torch.float32)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            tokens = [t async for delta in backend.generate([30, 31, 32], params)
                      for t in delta.token_ids]  # fmt: skip
        finally:
            await backend.aclose()
            backend.unload()
        assert len(tokens) == 4
        assert seen and set(seen) == {2}
        # Nobody else's count moved: this thread and new threads keep one.
        assert torch.get_num_threads() == 1
        assert start_up_count() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("quantization", [None, "int8"])
async def test_greedy_output_repeats_exactly_with_compute_threads(
    llama: Path, monkeypatch: pytest.MonkeyPatch, quantization: str | None
) -> None:
    before = torch.get_num_threads()
    monkeypatch.setattr(threads_module, "_compute", None)
    only_compute_threads(2)
    try:
        config: dict[str, object] = {"kv_cache_bytes": 2 * 2**20}
        if quantization:
            config["quantization"] = quantization
        backend = LLMBackend(BackendContext("tiny", "1", config))
        backend.load(llama, "cpu", torch.float32)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            runs = []
            for _ in range(4):
                runs.append([t async for delta in backend.generate(list(range(7, 19)), params)
                             for t in delta.token_ids])  # fmt: skip
        finally:
            await backend.aclose()
            backend.unload()
        assert all(run == runs[0] for run in runs), runs
    finally:
        torch.set_num_threads(before)


async def test_the_torch_decode_path_leaves_new_threads_at_one(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the native kernels the step thread runs decode attention on one thread at a
    time (`single_threaded`); afterwards threads still start at one."""
    before = torch.get_num_threads()
    monkeypatch.setattr(threads_module, "_compute", None)
    only_compute_threads(2)
    try:
        context = LLMContext(
            "tiny", "1", {"kv_cache_bytes": 2 * 2**20}, kernels=KernelSettings(enabled=False)
        )
        backend = LLMBackend(context)
        backend.load(llama, "cpu", torch.float32)
        try:
            assert backend.engine.runner.native_linear == 0  # torch's path throughout
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            async for _ in backend.generate([30, 31, 32], params):
                pass
        finally:
            await backend.aclose()
            backend.unload()
        assert start_up_count() == 1
    finally:
        torch.set_num_threads(before)
