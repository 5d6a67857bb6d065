"""The fused Triton kernels (backends/llm/triton_fused.py): only code that is Llama's is
replaced, and on a CUDA device (tests marked `cuda`, skipped without one) each kernel equals
the torch code it replaces, an engine's greedy tokens stay the same, and a static decode step
launches far fewer kernels."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from backends.llm import triton_fused
from backends.tiny import TINY_LLM_ARCHITECTURES
from tests.backends.llm.support import build_model

# What each tiny architecture's code allows: (its RMSNorms, its MLPs, its rotary function).
# Gemma's norm scales by (1 + weight), OLMo-2's multiplies before the cast, Gemma's MLP is a
# GELU, Phi-3's projects gate and up in one product, Phi-3's and OLMo-2's rotary differ.
FUSED = {
    "llama": (True, True, True),
    "mistral": (True, True, True),
    "qwen2": (True, True, True),
    "qwen3": (True, True, True),
    "phi3": (True, False, False),
    "gemma2": (False, False, True),
    "gemma3_text": (False, False, True),
    "granite": (True, True, True),
    "olmo2": (False, True, False),
    "mixtral": (True, False, True),
    "qwen2_moe": (True, True, True),
    "qwen3_moe": (True, False, True),  # experts only: no dense MLP to fuse
}

cuda = pytest.mark.cuda


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fused-models")


def test_every_tiny_architecture_is_accounted_for() -> None:
    assert set(FUSED) == set(TINY_LLM_ARCHITECTURES)


@pytest.mark.parametrize("arch", TINY_LLM_ARCHITECTURES)
def test_only_code_that_is_llamas_is_fused(arch: str, models_root: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_model(models_root, arch))
    norms, mlps, modeling = triton_fused.plan(model)
    all_norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    all_mlps = [m for m in model.modules() if type(m).__name__.endswith("MLP")]
    want_norms, want_mlps, want_rotary = FUSED[arch]
    assert (norms == all_norms) if want_norms else not norms
    assert (mlps == all_mlps and mlps) if want_mlps else not mlps
    assert bool(modeling) == want_rotary
    assert all(m.__name__.startswith("transformers.models.") for m in modeling)


@cuda
@pytest.mark.parametrize("arch", ["llama", "gemma2", "phi3"])
def test_a_fused_model_moved_to_the_cpu_computes_what_it_did(arch: str, models_root: Path) -> None:
    # Where Triton is installed (a GPU machine), the fused forwards of a model on the CPU, even
    # inside `active()`, fall back to the torch code exactly (a restore parks models there).
    if triton_fused._build() is None:
        pytest.skip("needs Triton")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_model(models_root, arch))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.inference_mode():
        before = model(ids).logits
        assert triton_fused.install(model) > 0
        with triton_fused.active():
            after = model(ids).logits
    assert torch.equal(before, after)


# ---- on a CUDA device ------------------------------------------------------------------
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2048), (64, 2048), (3, 1, 5, 128), (7, 40)])
def test_rms_norm_equals_llamas(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    _skip_without_cuda()
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(*shape, generator=gen)).to("cuda", dtype)
    norm = LlamaRMSNorm(shape[-1], eps=1e-5).to("cuda", dtype)
    norm.weight.data.copy_(torch.randn(shape[-1], generator=gen).to("cuda", dtype))
    with torch.inference_mode():
        want = norm(x)
        got = triton_fused.rms_norm(x, norm.weight, 1e-5)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **_tolerance(dtype))


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["attention", "contiguous"])
def test_rotary_equals_llamas(dtype: torch.dtype, layout: str) -> None:
    _skip_without_cuda()
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to("cuda", dtype)

    if layout == "attention":  # (1, T, H, D) projections viewed as (1, H, T, D)
        q, k = rand(1, 37, 8, 64).transpose(1, 2), rand(1, 37, 2, 64).transpose(1, 2)
        cos, sin = rand(1, 37, 64), rand(1, 37, 64)
    else:  # a batch of two, cos and sin shared
        q, k = rand(2, 4, 5, 128), rand(2, 1, 5, 128)
        cos, sin = rand(1, 5, 128), rand(1, 5, 128)
    with torch.inference_mode():
        want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
        got_q, got_k = triton_fused.rotary(q, cos, sin), triton_fused.rotary(k, cos, sin)
        for x, got, want in ((q, got_q, want_q), (k, got_k, want_k)):
            # Each of the two products is rounded to the dtype before the sum: where the sum
            # cancels, a different rounding shows at the scale of the products, not the sum's.
            x, c, s = x.float(), cos.float()[:, None], sin.float()[:, None]
            half = x.shape[-1] // 2
            rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
            scale = (x * c).abs() + (rotated * s).abs()
            limit = 2 * torch.finfo(dtype).eps * scale + 1e-6
            assert got.dtype == want.dtype and got.shape == want.shape
            assert ((got.float() - want.float()).abs() <= limit).all()


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_the_two_torch_ops(dtype: torch.dtype) -> None:
    _skip_without_cuda()
    gen = torch.Generator().manual_seed(2)
    gate = (4 * torch.randn(9, 5632, generator=gen)).to("cuda", dtype)
    up = torch.randn(9, 5632, generator=gen).to("cuda", dtype)
    with torch.inference_mode():
        want = torch.nn.functional.silu(gate) * up
        got = triton_fused.silu_mul(gate, up)
    torch.testing.assert_close(got, want, **_tolerance(dtype))


@cuda
def test_an_engine_with_fused_kernels_keeps_its_tokens_and_launches_fewer(
    models_root: Path,
) -> None:
    _skip_without_cuda()
    from torch.profiler import ProfilerActivity, profile

    from backends.llm.config import EngineConfig
    from backends.llm.engine import LLMEngine
    from backends.llm.model_runner import ModelRunner
    from backends.llm.sampling_params import SamplingParams

    folder = build_model(models_root, "llama")
    logits, kernels = {}, {}
    for fused in (False, True):
        # The static decode step, eagerly (graphs off), so that the profiler sees its kernels.
        config = EngineConfig(kv_cache_bytes=64 * 2**20, cuda_graphs=False, gpu_fused_ops=fused)
        runner = ModelRunner.load(folder, "cuda:0", torch.float32, config, static_decode=True)
        assert (runner.gpu_fused_ops > 0) == fused
        engine = LLMEngine(config, runner)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for i in range(3):
            engine.add_request(f"r{i}", [5 + i, 9, 14, 30, 2 + i], params)
        engine.step()  # the prefill (the torch code either way): the same first tokens
        eager_steps = runner.graphs.stats.eager_steps
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.step()  # the first decode, through the static step
            torch.cuda.synchronize()
        assert runner.graphs.stats.eager_steps == eager_steps + 1
        assert runner.graphs.step is not None and runner.graphs.step.logits is not None
        logits[fused] = runner.graphs.step.logits[:3].clone()
        kernels[fused] = sum(e.count for e in prof.key_averages() if e.self_device_time_total > 0)
        while engine.has_work():
            engine.step()
    # float32, the same inputs: only the order of the norms' sums differs.
    torch.testing.assert_close(logits[True], logits[False], atol=1e-4, rtol=1e-4)
    # Two layers: each float32 RMSNorm 6 kernels -> 1 (two a layer and the final one), the
    # rotary 10 -> 2, SiLU-and-multiply 2 -> 1: 43 fewer.
    assert kernels[False] - kernels[True] >= 30, kernels


def _skip_without_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if triton_fused._build() is None:
        pytest.skip("needs Triton")
    assert triton_fused.works_on(torch.device("cuda:0"))


def _tolerance(dtype: torch.dtype) -> dict[str, Any]:
    """float32: the sum's order; half types: one unit in the last place (near a sum that
    cancels, that unit is the terms', hence the absolute part)."""
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    if dtype == torch.bfloat16:
        return {"atol": 1.6e-2, "rtol": 1.6e-2}
    return {"atol": 2e-3, "rtol": 2e-3}
