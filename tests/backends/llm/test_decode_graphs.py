"""The static-buffer decode step (backends/llm/decode_graphs.py), run eagerly on the CPU: the
code a GPU captures and replays. Greedy tokens equal transformers' and the packed step's,
with batches padded to a bucket (9 -> 16, 3 -> 4) and sequences finishing mid-batch, for
plain, sliding-window and soft-capped models; padding rows never touch a sequence's blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from backends.llm.decode_graphs import MAX_BUCKET, bucket_for, bucket_sizes
from backends.llm.engine import LLMEngine
from backends.llm.sampling_params import SamplingParams
from backends.runtime_config import LLMConfig, RuntimeConfigError
from tests.backends.llm.support import (
    Completion,
    build_model,
    greedy_with_tops,
    kv_bytes,
    make_engine,
    random_prompts,
    run_all,
)

BLOCK_SIZE = 4
TOP = 5
# Nine sequences ending one after another: decode steps of 9 rows (bucket 16) down to 1.
MAX_TOKENS = [3, 5, 7, 9, 11, 13, 15, 17, 19]


def test_bucket_ladder() -> None:
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert bucket_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    assert bucket_sizes(3) == [1, 2, 3]
    assert bucket_sizes(10_000)[-1] == MAX_BUCKET
    ladder = bucket_sizes(64)
    assert [bucket_for(ladder, n) for n in (1, 3, 5, 9, 17, 64)] == [1, 4, 8, 16, 24, 64]
    assert bucket_for(ladder, 65) is None


def test_runtime_config_takes_cuda_graphs() -> None:
    assert LLMConfig.parse({}).cuda_graphs == "auto"
    assert LLMConfig.parse({"cuda_graphs": False}).cuda_graphs is False
    assert LLMConfig.parse({"cuda_graph_mode": "compile"}).cuda_graph_mode == "compile"
    for bad in ({"cuda_graphs": "yes"}, {"cuda_graphs": 1}, {"cuda_graph_mode": "jit"}):
        with pytest.raises(RuntimeConfigError) as err:
            LLMConfig.parse(bad)
        assert err.value.key == next(iter(bad))


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("decode-graph-models")


def workload() -> list[tuple[list[int], SamplingParams]]:
    prompts = random_prompts(len(MAX_TOKENS), seed=7, lengths=(3, 40))
    return [
        (p, SamplingParams(temperature=0.0, max_tokens=m, logprobs=TOP, ignore_eos=True))
        for p, m in zip(prompts, MAX_TOKENS, strict=True)
    ]


def engine(folder: Path, static: bool, **config: Any) -> LLMEngine:
    settings: dict[str, Any] = {
        "block_size": BLOCK_SIZE,
        "max_num_seqs": 16,
        "max_model_len": 96,
        "fused_step": False,
        **config,
    }
    return make_engine(folder, batched_decode=True, static_decode=static, **settings)


def tokens(results: list[list[Completion]]) -> list[list[int]]:
    return [c.token_ids for samples in results for c in samples]


def near_tie_or_equal(ref: tuple[list[int], list[set[int]]], ours: Completion) -> bool:
    """Equal to transformers, or apart first where both have the other's token in their
    top 5 (float rounding picking between two near-equal logits)."""
    hf_tokens, hf_tops = ref
    for i, (a, b) in enumerate(zip(hf_tokens, ours.token_ids, strict=False)):
        if a != b:
            return b in hf_tops[i] and a in {t for t, _ in ours.logprobs[i].top}
    return len(hf_tokens) == len(ours.token_ids)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "mistral", "phi3", "qwen3_moe"])
def test_static_decode_equals_the_packed_step_and_transformers(
    arch: str, models_root: Path
) -> None:
    from transformers import AutoModelForCausalLM

    folder = build_model(models_root, arch)
    requests = workload()
    static = engine(folder, True)
    ours = run_all(static, requests)
    stats = static.runner.graphs.stats
    # Decode-only steps took the static path, padded: 9 rows -> 16, 3 -> 4, ... 1.
    assert set(stats.steps_by_bucket) == {1, 2, 4, 8, 16}
    assert stats.replays == 0 and stats.eager_steps == sum(stats.steps_by_bucket.values())
    packed = run_all(engine(folder, False), requests)
    assert tokens(ours) == tokens(packed)

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    model.generation_config.eos_token_id = None  # as `ignore_eos`
    for (prompt, params), samples in zip(requests, ours, strict=True):
        (ref,) = greedy_with_tops(model, [prompt], params.max_tokens or 0, TOP)
        assert near_tie_or_equal(ref, samples[0]), (arch, ref[0], samples[0].token_ids)


def test_padding_rows_write_only_the_scratch_block(models_root: Path) -> None:
    """Under preemption (a pool of 24 blocks), the pool never hands out the scratch block,
    the outputs stay the packed step's, and padding rows wrote into the scratch block only."""
    folder = build_model(models_root, "llama")
    requests = workload()
    tight = {"kv_cache_bytes": kv_bytes(folder, 24, BLOCK_SIZE)}
    static = engine(folder, True, **tight)
    runner = static.runner
    assert static.kv_cache.pool.num_blocks == runner.num_blocks == 24
    assert runner.kv_caches[0].shape[1] == runner.num_blocks + 1  # the scratch block
    for i, (prompt, params) in enumerate(requests):
        static.add_request(str(i), prompt, params)
    results: dict[str, list[int]] = {}
    while static.has_work():
        for out in static.step():
            results.setdefault(out.request_id, []).extend(out.token_ids)
        for seq in static.scheduler.running:
            assert all(0 <= b < runner.num_blocks for b in seq.block_ids)
    assert static.scheduler.num_preemptions > 0
    assert runner.graphs.stats.eager_steps > 0
    # No sequence owns the scratch block, yet it holds K/V: the padding rows' (3 -> 4, ...).
    scratch = runner.kv_caches[0][:, runner.num_blocks]
    assert scratch.abs().sum() > 0

    packed = engine(folder, False, **tight)
    expected = run_all(packed, requests)
    assert [results[str(i)] for i in range(len(requests))] == tokens(expected)


def test_steps_it_cannot_take_run_as_before(models_root: Path) -> None:
    """Batches past the ladder run the packed step, the others the static one, with the same
    tokens; switched off, nothing of it is built."""
    folder = build_model(models_root, "llama")
    requests = workload()
    short = engine(folder, True)
    short.runner.graphs.buckets = [1, 2]  # a ladder shorter than the batches
    results = run_all(short, requests)
    assert set(short.runner.graphs.stats.steps_by_bucket) == {1, 2}
    off = engine(folder, False)
    assert tokens(run_all(off, requests)) == tokens(results)
    assert off.runner.graphs.stats.steps_by_bucket == {}
    assert off.runner.kv_caches[0].shape[1] == off.runner.num_blocks  # no scratch block
    assert off.runner.graph_bytes() == 0


def test_static_step_is_rebuilt_after_offload_and_restore(models_root: Path) -> None:
    folder = build_model(models_root, "gemma2")
    requests = workload()
    eng = engine(folder, True)
    runner = eng.runner
    first = tokens(run_all(eng, requests))
    assert runner.graph_bytes() > 0  # its buffers
    runner.release_kv_cache()  # an offload
    assert runner.graph_bytes() == 0
    runner.to("cpu")
    runner.allocate_kv_cache()  # a restore
    eng.reset_cache()
    assert runner.kv_caches[0].shape[1] == runner.num_blocks + 1
    steps_before = runner.graphs.stats.eager_steps
    assert tokens(run_all(eng, requests)) == first
    assert runner.graphs.stats.eager_steps > steps_before


def test_steps_with_a_lora_adapter_take_the_packed_path(models_root: Path) -> None:
    """Graphs hold the base model only: a decode step with an adapter's sequence runs packed,
    one of base sequences alone runs static, and the outputs are the packed step's."""
    from backends.llm.lora import read_adapter
    from tests.backends.llm.lora_support import ATTENTION, build_adapter

    base = build_model(models_root, "llama")
    adapter = build_adapter(base, models_root / "llama-lora", ATTENTION)
    requests = workload()
    # Odd requests (ending at 5, 9, 13, 17 tokens) use the adapter; the last decodes are
    # the base's alone.
    owners: list[str | None] = ["a" if i % 2 else None for i in range(len(requests))]
    outputs, static_steps = [], []
    for static in (True, False):
        eng = engine(base, static)
        eng.runner.lora.add("a", read_adapter(adapter))
        calls: list[bool] = []
        for_step = eng.runner.graphs.for_step

        def recording(output: Any, for_step: Any = for_step, calls: list[bool] = calls) -> Any:
            step = for_step(output)
            if step is not None:
                assert all(item.seq.adapter is None for item in output.scheduled)
            calls.append(step is not None)
            return step

        eng.runner.graphs.for_step = recording  # type: ignore[method-assign]
        outputs.append(tokens(run_all(eng, requests, owners)))
        static_steps.append(sum(calls))
    assert outputs[0] == outputs[1]
    assert static_steps[0] > 0 and static_steps[1] == 0
