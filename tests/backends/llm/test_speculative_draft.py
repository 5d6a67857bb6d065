"""A draft model drafts for its target: greedy output is the target's (the target as its own
draft accepts nearly everything, another model nearly nothing), a draft with another
tokenizer is refused by name, and the backend loads, charges, moves and frees the draft with
its target."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from backends.llm.engine import LLMEngine
from backends.llm.sampling_params import SamplingParams
from backends.runtime_config import SpeculativeConfig
from tests.backends.llm.speculative_support import (
    BLOCK_SIZE,
    STEP_BUDGET,
    assert_same,
    engine,
    speculating_always,
    workload,
)
from tests.backends.llm.support import build_model, kv_bytes, run_all


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("speculative-models")


# ---- a draft model -------------------------------------------------------------------------
def draft_engine(
    folder: Path, draft_folder: Path, k: int, min_confidence: float = 0.0, **config: Any
) -> LLMEngine:
    from backends.llm.config import EngineConfig
    from backends.llm.model_runner import ModelRunner
    from backends.llm.speculative.draft_model import DraftModel

    options = {"block_size": BLOCK_SIZE, "max_num_seqs": 8, "max_num_batched_tokens": STEP_BUDGET}
    spec = SpeculativeConfig(draft="draft@1", num_tokens=k, max_batch=64)
    engine_config = EngineConfig(speculative=spec, **(options | config))
    runner = ModelRunner.load(folder, "cpu", torch.float32, engine_config)
    draft_config = EngineConfig(**(options | config))
    draft_runner = ModelRunner.load(draft_folder, "cpu", torch.float32, draft_config)
    draft = DraftModel(draft_runner, BLOCK_SIZE, STEP_BUDGET, min_confidence)
    draft.check_vocab(runner.vocab_size)
    return speculating_always(LLMEngine(engine_config, runner, proposer=draft))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_output_with_a_draft_model_equals_without(arch: str, root: Path) -> None:
    from backends.tiny import build_tiny_llm

    folder = build_model(root, arch)
    other = root / f"{arch}-draft"
    if not (other / "config.json").is_file():
        build_tiny_llm(other, arch, num_layers=1, seed=5)
    requests = workload()
    base = run_all(engine(folder, None), requests)
    # The target as its own draft: nearly every draft is accepted.
    same = draft_engine(folder, folder, 4)
    assert_same(base, run_all(same, requests))
    assert same.metrics.speculation.acceptance_rate > 0.9
    assert same.metrics.speculation.tokens_per_step > 3
    # The draft's small steps ran fused, on one thread.
    draft_runner = same.speculator.proposer.runner  # type: ignore[union-attr, attr-defined]
    assert draft_runner.fused.steps > 0 and draft_runner.fused.decoder.threads == 1
    # Another model: drafts mostly rejected, rolled back in both caches, output unchanged.
    # Preemption too (20 blocks of 4 tokens).
    small = {"kv_cache_bytes": kv_bytes(folder, 20, BLOCK_SIZE)}
    different = draft_engine(folder, other, 3, **small)
    assert_same(base, run_all(different, requests))
    assert different.metrics.speculation.proposed > 0
    assert different.scheduler.num_preemptions > 0
    assert different.kv_cache.pool.num_used_blocks == 0


def test_drafts_the_draft_model_is_unsure_of_are_not_proposed(root: Path) -> None:
    folder = build_model(root, "llama")
    requests = workload(max_tokens=12)
    base = run_all(engine(folder, None), requests)
    # A random model gives no token half its probability: only each step's first draft.
    unsure = draft_engine(folder, folder, 4, min_confidence=0.5)
    assert_same(base, run_all(unsure, requests))
    stats = unsure.metrics.speculation
    assert 0 < stats.proposed == stats.verify_steps
    sure = draft_engine(folder, folder, 4, min_confidence=0.0)
    assert_same(base, run_all(sure, requests))
    assert sure.metrics.speculation.proposed > 2 * sure.metrics.speculation.verify_steps


def test_a_draft_with_another_tokenizer_is_refused_by_name(root: Path) -> None:
    from transformers import AutoTokenizer

    from backends.errors import InputError
    from backends.llm.speculative.compat import check_same_tokenizer
    from backends.tiny import build_tiny_llm

    folder = build_model(root, "llama")
    other = root / "llama-other-vocab"
    if not (other / "config.json").is_file():
        build_tiny_llm(other, "llama", vocab_size=384)
    target = AutoTokenizer.from_pretrained(folder)
    check_same_tokenizer(target, AutoTokenizer.from_pretrained(folder))
    with pytest.raises(InputError, match="vocabulary of 384 tokens and the target 512"):
        check_same_tokenizer(target, AutoTokenizer.from_pretrained(other), "small@1")


async def test_the_backend_loads_moves_and_frees_the_draft_with_its_target(root: Path) -> None:
    from backends.base import BackendContext
    from backends.errors import LoadError
    from backends.llm.backend import LLMBackend
    from backends.llm.context import LLMContext
    from backends.llm.kernel_settings import KernelSettings
    from backends.loading import module_bytes
    from backends.tiny import build_tiny_llm

    folder = build_model(root, "llama")
    other_vocab = root / "llama-other-vocab"
    if not (other_vocab / "config.json").is_file():
        build_tiny_llm(other_vocab, "llama", vocab_size=384)
    # A random model is never sure of a token: every draft is proposed.
    spec = {"draft": "self@1", "num_tokens": 3, "min_draft_probability": 0.0}
    config = {"kv_cache_bytes": 2**20, "speculative": spec}

    def backend(draft_dir: Path | None) -> LLMBackend:
        context = BackendContext("t", "1", config)
        return LLMBackend(LLMContext.of(context, KernelSettings(), draft_dir=draft_dir))

    with pytest.raises(LoadError, match="not resolved"):
        backend(None).load(folder, "cpu", torch.float32)
    with pytest.raises(LoadError, match="vocabulary of 384 tokens"):
        backend(other_vocab).load(folder, "cpu", torch.float32)

    b = backend(folder)  # the target as its own draft
    b.load(folder, "cpu", torch.float32)
    weights = module_bytes(b.engine.runner.model)
    full = b.memory_bytes()
    assert full >= 2 * weights + 2 * 2**20  # both models and both caches are charged
    assert b.offload_bytes() == 2 * weights
    prompt = b.encode("the harbour the harbour the harbour")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def tokens() -> list[int]:
        return [t async for out in b.generate(prompt, params) for t in out.token_ids]

    before = await tokens()
    b.offload()
    assert b.memory_bytes() == 0
    b.restore("cpu")
    assert await tokens() == before
    stats = b.engine.metrics.speculation
    assert stats.acceptance_rate > 0.9
    await b.aclose()
    b.unload()
    assert b.memory_bytes() == 0
