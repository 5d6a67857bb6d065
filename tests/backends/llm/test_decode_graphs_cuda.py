"""Decode graphs and the Triton decode kernel on a CUDA device (skipped without one): a
graph replay equals the same static step run eagerly for every bucket, greedy tokens on the
graph path equal transformers', the kernel equals the torch reference, and tokens are the
same after an offload and a restore."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from backends.llm import attention, triton_decode
from backends.llm.attention import PagedAttentionMetadata
from backends.llm.config import EngineConfig
from backends.llm.decode_graphs import GraphStats, StaticDecode
from backends.llm.engine import LLMEngine
from backends.llm.model_runner import ModelRunner, kv_bytes_per_block
from backends.tiny import TINY_LLM_ARCHITECTURES
from tests.backends.llm.support import build_model, run_all
from tests.backends.llm.test_decode_graphs import TOP, near_tie_or_equal, tokens, workload

# Graphs are captured only where the Triton decode kernel runs.
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not triton_decode.available(), reason="needs Triton"),
]


# Mixture-of-experts architectures: their graphs may not capture (see below).
MOE_ARCHS = {"mixtral", "qwen2_moe", "qwen3_moe"}


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("decode-graph-cuda-models")


def cuda_engine(folder: Path, blocks: int = 2048, **config: Any) -> LLMEngine:
    from transformers import AutoConfig

    settings: dict[str, Any] = {"block_size": 16, "max_num_seqs": 64, "max_model_len": 256}
    settings.update(config)
    per_block = kv_bytes_per_block(
        AutoConfig.from_pretrained(folder), settings["block_size"], torch.float32
    )
    engine_config = EngineConfig(kv_cache_bytes=blocks * per_block, **settings)
    runner = ModelRunner.load(folder, "cuda:0", torch.float32, engine_config)
    return LLMEngine(engine_config, runner)


@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (20, None), (None, 30.0), (9, 5.0)])
@pytest.mark.parametrize("shape", [(16, 8, 2, 64), (4, 4, 4, 96), (5, 6, 2, 80), (16, 8, 1, 128)])
def test_triton_decode_equals_the_torch_reference(
    dtype: torch.dtype,
    window: int | None,
    softcap: float | None,
    shape: tuple[int, int, int, int],
    split: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Both kernels: the split-context one (contexts over several splits of
    # `triton_decode.SPLIT` tokens, merged) and the one-pass one it falls back to.
    monkeypatch.setitem(triton_decode._SPLIT_ON, "cuda:0", split)
    block_size, heads, kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(0)
    num_blocks, width = 48, 40
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to("cuda", dtype)
    long = min(300, width * block_size - 3)
    lens = [1, 2, block_size, block_size + 1, long, width * block_size, 3 * block_size - 1]
    b = len(lens)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(b)])
    tables, lens_t = tables.cuda(), torch.tensor(lens, device="cuda")
    query = torch.randn(1, heads, b + 2, head_dim, generator=gen).to("cuda", dtype)
    scale = head_dim**-0.5
    expected = torch.zeros(b + 2, heads, head_dim, device="cuda", dtype=dtype)
    meta = PagedAttentionMetadata(
        kv_caches=[kv], slot_mapping=torch.zeros(0), decode_batch=(tables, lens_t)
    )
    blocks = kv.view(2, num_blocks, -1)
    attention._decode_batched(meta, query, blocks, expected, scale, window, softcap)
    out = torch.zeros_like(expected)
    triton_decode.paged_decode(query, kv, tables, lens_t, out, scale, window, softcap)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:b].float(), expected[:b].float(), atol=tol, rtol=tol)
    assert not out[b:].any()  # rows past the decodes are left alone


def test_graph_replay_equals_the_eager_static_step_for_every_bucket(models_root: Path) -> None:
    engine = cuda_engine(build_model(models_root, "llama"))
    runner = engine.runner
    assert runner.graphs.graphs_enabled
    assert runner.graphs.stats.captures == len(runner.graphs.buckets)  # all at load
    assert runner.graphs.stats.capture_seconds > 0 and runner.graph_bytes() > 0
    for kv in runner.kv_caches:  # a cache full of context
        kv[:, : runner.num_blocks].normal_()
    graphs = runner.graphs.step
    assert graphs is not None
    eager = StaticDecode(
        runner.model,
        runner.kv_caches,
        buckets=runner.graphs.buckets,
        max_model_len=runner.max_model_len,
        scratch_block=runner.num_blocks,
        device=runner.device,
        capture=False,
        stats=GraphStats(),
        decode_kernel=graphs.decode_kernel,
    )
    rng = random.Random(0)
    with torch.inference_mode():  # as the runner's steps run
        for size in runner.graphs.buckets:
            for rows in {size, max(1, size - 1)}:  # full, and padded by one
                free = list(range(runner.num_blocks))
                rng.shuffle(free)
                items = []
                for _ in range(rows):
                    pos = rng.randrange(0, runner.max_model_len)
                    table = [free.pop() for _ in range(pos // runner.block_size + 1)]
                    token_ids = [rng.randrange(500)] * (pos + 1)
                    seq = SimpleNamespace(token_ids=token_ids, block_ids=table)
                    items.append(SimpleNamespace(seq=seq, start=pos, num_tokens=1, sample=True))
                replayed = graphs.run(items).clone()  # type: ignore[arg-type]
                expected = eager.run(items).clone()  # type: ignore[arg-type]
                torch.testing.assert_close(replayed, expected, atol=1e-4, rtol=1e-4)
    assert runner.graphs.stats.replays > 0


@pytest.mark.parametrize("arch", TINY_LLM_ARCHITECTURES)
def test_greedy_on_the_graph_path_equals_transformers(arch: str, models_root: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = build_model(models_root, arch)
    engine = cuda_engine(folder)
    requests = workload()
    ours = run_all(engine, requests)
    stats = engine.runner.graphs.stats
    if arch in MOE_ARCHS and engine.runner.graphs.failed is not None:
        # transformers' expert dispatch asks the host which experts a step hit (`nonzero`),
        # which no graph can record: such a model decodes eagerly, said once in the log.
        assert stats.replays == 0
    else:
        assert engine.runner.graphs.graphs_enabled, engine.runner.graphs.failed
        assert stats.replays > 0 and stats.eager_steps == 0

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).to("cuda:0")
    model.generation_config.eos_token_id = None  # as `ignore_eos`
    for (prompt, params), samples in zip(requests, ours, strict=True):
        with torch.inference_mode():
            (ref,) = _greedy(model, prompt, params.max_tokens or 0)
        assert near_tie_or_equal(ref, samples[0]), (arch, ref[0], samples[0].token_ids)


def _greedy(model: Any, prompt: list[int], max_tokens: int) -> Any:
    """transformers' greedy tokens and top-5 ids per position, inputs on the model's device."""
    out = model.generate(
        input_ids=torch.tensor([prompt], device=model.device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
        max_new_tokens=max_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tops = [set(step[0].topk(TOP).indices.tolist()) for step in out.logits]
    return [(out.sequences[0, len(prompt) :].tolist(), tops)]


def test_same_tokens_after_offload_and_restore(models_root: Path) -> None:
    engine = cuda_engine(build_model(models_root, "gemma2"))
    runner = engine.runner
    requests = workload()
    first = tokens(run_all(engine, requests))
    captures = runner.graphs.stats.captures
    runner.release_kv_cache()
    runner.to("cpu")
    assert runner.graph_bytes() == 0
    runner.to("cuda:0")
    runner.allocate_kv_cache()
    engine.reset_cache()
    assert tokens(run_all(engine, requests)) == first
    assert runner.graphs.stats.captures > captures  # captured again, as steps needed them


def test_steps_launched_ahead_replay_the_same_tokens(models_root: Path) -> None:
    """`async_steps` on the graph path: inputs still in flight are fed on the device and the
    inputs are copied without a wait; the tokens are those of synchronous steps."""
    from backends.llm.sampling_params import SamplingParams

    folder = build_model(models_root, "llama")
    prompts = [p for p, _ in workload()]
    requests = [
        (p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
        for p, m in zip(prompts, [3, 9, 17, 30, 41, 8, 1, 25, 12], strict=True)
    ]
    sync = tokens(run_all(cuda_engine(folder), requests))
    engine = cuda_engine(folder, async_steps=True)
    ahead = 0
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
        ahead += engine.in_flight
    assert [got[str(i)] for i in range(len(requests))] == sync
    assert ahead > 20 and engine.runner.graphs.stats.replays > 0
