"""The native linear kernel for few-row products (decode at a small batch): equal to torch's
`F.linear` over odd shapes, with and without bias, and installed in a model's linear layers
it is what runs at up to MAX_ROWS rows, with torch's path beyond."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from backends.llm import cpu_linear, native_build
from backends.llm.kernel_settings import KernelSettings


@functools.cache
def kernel() -> cpu_linear.LinearKernel:
    built = cpu_linear.linear_kernel(KernelSettings())  # the instance `install` uses
    if built is None:
        compiler = os.environ.get("CC") or "cc"
        pytest.skip(f"no threaded build loads (none built, no GNU OpenMP or no {compiler!r})")
    return built


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 64), (130, 37), (3, 200)])
@pytest.mark.parametrize("bias", [True, False])
def test_equals_torch(rows: int, out_features: int, in_features: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    x = torch.randn(1, rows, in_features, generator=generator)
    got = kernel()(x, weight, b)
    assert got.shape == (1, rows, out_features)
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


def test_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="features"):
        kernel()(torch.randn(1, 8), torch.randn(4, 9), None)
    with pytest.raises(ValueError, match="bias"):
        kernel()(torch.randn(1, 8), torch.randn(4, 8), torch.randn(5))


class Counting:
    """The kernel's C function, counting its calls (the kernel still computes)."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args: Any) -> int:
        self.calls += 1
        return int(self.fn(*args))


def test_installed_in_a_model_it_runs_few_rows_and_torch_the_rest(tiny_llm_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    built = kernel()
    model = AutoModelForCausalLM.from_pretrained(tiny_llm_dir, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny_llm_dir, dtype=torch.float32)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert cpu_linear.install(model) == linears > 0

    counting = Counting(built._fn)
    built._fn = counting
    try:
        with torch.inference_mode():
            few = torch.tensor([[5, 9, 11]])
            torch.testing.assert_close(
                model(few).logits, reference.eval()(few).logits, rtol=1e-4, atol=1e-4
            )
            assert counting.calls == linears  # every linear layer, once
            many = torch.arange(3, 3 + cpu_linear.MAX_ROWS + 1).unsqueeze(0)
            torch.testing.assert_close(model(many).logits, reference(many).logits)
            assert counting.calls == linears  # more rows than MAX_ROWS: torch's path
    finally:
        built._fn = counting.fn


def test_switched_off_or_unavailable_nothing_is_installed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    off = KernelSettings(enabled=False, cache_dir=tmp_path)
    assert cpu_linear.install(model, off) == 0
    monkeypatch.setattr(native_build, "BUILT_DIR", tmp_path / "not-built")
    missing = KernelSettings(cache_dir=tmp_path, compiler="no-such-compiler-here")
    assert cpu_linear.install(model, missing) == 0
    assert "forward" not in vars(model[0])


def test_the_kernel_itself_refuses_sizes_out_of_range() -> None:
    """The C entry point, called directly with no buffers, refuses rather than reads."""
    fn = kernel()._fn
    assert fn(None, 1, None, None, None, 4, 4, 1) == 2  # csrc/check.h HUB_BAD_SHAPE
    assert fn(None, -1, None, None, None, 4, 4, 1) == 2
    assert fn(None, 0, None, None, None, 4, 4, 1) == 0  # no rows: nothing to read
