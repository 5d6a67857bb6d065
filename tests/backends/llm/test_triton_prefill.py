"""Prefill attention of a step's chunks as one varlen batch: the torch reference against plain
dense attention (here), and the Triton kernel against the reference, on a CUDA device
(marked `cuda`) and under Triton's interpreter where Triton is importable (CPU tensors)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.llm import triton_prefill
from backends.llm.triton_prefill import PrefillBatch
from tests.backends.llm.support import build_model, make_engine, run_all
from tests.backends.llm.test_attention import dense
from tests.backends.llm.test_correctness import (
    BLOCK_SIZE,
    STEP_BUDGET,
    check_run,
    hf_reference,
    workload,
)

NUM_BLOCKS = 96

# Sequences of a step: (tokens already cached, tokens of this step's chunk).
FRESH = [(0, 37)]  # one prompt, no earlier context
PREFIX = [(32, 21), (0, 5)]  # a prefix-cache hit (whole blocks), and a short prompt
CONTINUED = [(45, 70), (3, 17), (0, 2)]  # chunked prefills after partial blocks
MIXES = {"fresh": FRESH, "prefix": PREFIX, "continued": CONTINUED}


@dataclass(frozen=True)
class Step:
    kv_cache: torch.Tensor  # (2, NUM_BLOCKS, block, KV, D), every position written
    query: torch.Tensor  # (1, H, T, D), as transformers passes it
    batch: PrefillBatch
    expected: torch.Tensor  # (T, H, D): dense attention in float32
    rows: range  # the chunks' packed rows (the first are decodes this test leaves alone)


def make_step(
    plan: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block: int,
    window: int | None,
    softcap: float | None,
    scale: float,
    dtype: torch.dtype,
    device: str,
) -> Step:
    """A step of prefill chunks after two decode rows, its K/V already scattered into
    scattered cache blocks, and what dense attention makes of it."""
    gen = torch.Generator().manual_seed(len(plan) * 1000 + heads * 10 + head_dim)
    kv_cache = torch.zeros(2, NUM_BLOCKS, block, kv_heads, head_dim)
    free = iter(torch.randperm(NUM_BLOCKS, generator=gen).tolist())
    decodes = 2
    query = [torch.randn(decodes, heads, head_dim, generator=gen)]
    expected = [torch.zeros(decodes, heads, head_dim)]
    starts, contexts, tables = [decodes], [], []
    for cached, new in plan:
        total = cached + new
        k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
        q = torch.randn(new, heads, head_dim, generator=gen).to(dtype)
        table = [next(free) for _ in range(-(-total // block))]
        for p in range(total):
            kv_cache[0, table[p // block], p % block] = k[p].float()
            kv_cache[1, table[p // block], p % block] = v[p].float()
        positions = range(cached, total)
        expected.append(dense(q.float(), k.float(), v.float(), positions, window, softcap, scale))
        query.append(q.float())
        starts.append(starts[-1] + new)
        contexts.append(cached)
        tables.append(table)
    packed = torch.cat(query).to(dtype)  # (T, H, D)
    return Step(
        kv_cache=kv_cache.to(device, dtype),
        query=packed.transpose(0, 1)[None].to(device),
        batch=PrefillBatch.build(starts, contexts, tables, device),
        expected=torch.cat(expected),
        rows=range(decodes, starts[-1]),
    )


Attend = Callable[..., None]


def check(
    attend: Attend,
    plan: list[tuple[int, int]],
    shape: tuple[int, int, int, int],
    window: int | None,
    softcap: float | None,
    dtype: torch.dtype,
    device: str,
) -> None:
    """`attend` (the kernel or the reference) over `plan` equals dense attention on the
    chunks' rows and leaves the decode rows as they were."""
    heads, kv_heads, head_dim, block = shape
    scale = head_dim**-0.5
    step = make_step(plan, heads, kv_heads, head_dim, block, window, softcap, scale, dtype, device)
    total = step.rows.stop
    out = torch.full((total, heads, head_dim), 7.0, dtype=dtype, device=device)
    attend(step.query, step.kv_cache, step.batch, out, scale, window, softcap)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    got = out.float().cpu()
    torch.testing.assert_close(got[step.rows], step.expected[step.rows], atol=tol, rtol=tol)
    assert bool((got[: step.rows.start] == 7.0).all()), "decode rows are not the kernel's"


# (query heads, KV heads, head size, block size): groups of 1, 4 and 8; head sizes 64, 128.
SHAPES = [(4, 4, 64, 16), (8, 2, 128, 16), (16, 2, 64, 32), (6, 3, 80, 8)]
FEATURES = [(None, None), (24, None), (None, 20.0), (9, 5.0)]  # (sliding window, soft-cap)


@pytest.mark.parametrize(("window", "softcap"), FEATURES)
@pytest.mark.parametrize("mix", MIXES)
def test_the_torch_reference_equals_dense_attention(
    mix: str, window: int | None, softcap: float | None
) -> None:
    attend = triton_prefill.paged_prefill_reference
    check(attend, MIXES[mix], (8, 2, 16, 4), window, softcap, torch.float32, "cpu")


def test_a_batch_needs_one_more_start_than_chunks() -> None:
    with pytest.raises(ValueError, match="N \\+ 1 query starts"):
        PrefillBatch.build([0, 4], [0, 0], [[1], [2]], "cpu")


def test_without_cuda_there_is_no_prefill_kernel() -> None:
    assert triton_prefill.kernel_for(torch.device("cpu")) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not triton_prefill.available(), reason="needs Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), FEATURES)
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_prefill_equals_the_torch_reference_on_cuda(
    shape: tuple[int, int, int, int],
    mix: str,
    window: int | None,
    softcap: float | None,
    dtype: torch.dtype,
) -> None:
    heads, kv_heads, head_dim, block = shape
    found = triton_prefill.kernel_for(
        torch.device("cuda:0"), dtype, (heads, kv_heads, head_dim, block)
    )
    assert found is not None, "the self-check failed"
    check(triton_prefill.paged_prefill, MIXES[mix], shape, window, softcap, dtype, "cuda:0")


@pytest.fixture
def interpreted() -> None:
    """The kernel runs on CPU tensors in Triton's interpreter, which must be chosen before
    Triton is first imported: run these with TRITON_INTERPRET=1 in the environment."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (Triton's interpreter)")
    if not triton_prefill.available():
        pytest.skip("needs Triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), FEATURES)
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_prefill_under_the_interpreter_equals_dense_attention(
    interpreted: None,
    shape: tuple[int, int, int, int],
    mix: str,
    window: int | None,
    softcap: float | None,
    dtype: torch.dtype,
) -> None:
    check(triton_prefill.paged_prefill, MIXES[mix], shape, window, softcap, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_self_check_passes_under_the_interpreter(
    interpreted: None, dtype: torch.dtype, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        for shape in SHAPES:
            assert triton_prefill._works_on.__wrapped__("cpu", dtype, shape)
    assert "not used" not in caplog.text


def test_a_kernel_that_disagrees_with_torch_is_not_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the kernel computes something else (here: it writes nothing), the self-check
    refuses it and says why, and the caller keeps the torch path."""
    monkeypatch.setattr(triton_prefill, "paged_prefill", lambda *args: None)
    with caplog.at_level(logging.WARNING):
        assert not triton_prefill._works_on.__wrapped__("cpu", torch.float32, SHAPES[0])
    assert "disagrees with the torch path" in caplog.text


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("varlen-prefill-models")


# Architectures with grouped heads, a sliding window, and soft-capping with windows.
ENGINE_ARCHITECTURES = ["llama", "mistral", "gemma2"]


@pytest.mark.parametrize("arch", ENGINE_ARCHITECTURES)
def test_greedy_output_with_one_varlen_prefill_per_layer_equals_transformers(
    arch: str, models_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner packs every step's chunks into one `PrefillBatch` and attention calls the
    prefill kernel once per layer: on the CPU the torch reference stands in for it, and the
    interpreted Triton kernel does under TRITON_INTERPRET=1. Chunked prefill and prefix hits
    included; greedy tokens equal transformers' (near-ties aside)."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1" and triton_prefill.available()
    kernel = triton_prefill.paged_prefill if interpret else triton_prefill.paged_prefill_reference
    calls: list[PrefillBatch] = []

    def counted(query: torch.Tensor, kv: torch.Tensor, batch: PrefillBatch, *rest: Any) -> None:
        calls.append(batch)
        kernel(query, kv, batch, *rest)

    monkeypatch.setattr(triton_prefill, "kernel_for", lambda *args: counted)
    folder = build_model(models_root, arch)
    requests = workload()
    refs = hf_reference(folder, [p for p, _ in requests])
    engine = make_engine(
        folder,
        batched_decode=True,
        fused_step=False,
        block_size=BLOCK_SIZE,
        max_num_seqs=8,
        max_num_batched_tokens=STEP_BUDGET,
    )
    check_run(f"{arch} varlen prefill", refs, run_all(engine, requests))
    assert engine.kv_cache.prefix_hits > 0
    batches = {id(batch): batch for batch in calls}.values()
    assert any(len(b.context_starts) > 1 for b in batches), "no step packed several chunks"
    assert any(bool((b.context_starts > 0).any()) for b in batches), "no chunk had context"
