"""The linear layers of a float32 model on a CPU, at a few rows, through a native kernel.

A decode step at batch 1 is a stream of the weights: each token reads every linear layer's
weights once (88 MB for the 26M benchmark Llama), and torch's BLAS path for a one-row
product runs on a single core, well below what the memory delivers.
`csrc/linear.c` splits the output rows over the calling thread's torch threads (the OpenMP
runtime torch has loaded) and reads them several times faster: the linear layers of a batch-1 step
take half the time or less. From `MAX_ROWS` rows on, torch's matrix product (which reuses each
weight for every row) wins and is used.

`install(model, settings)` switches every plain `nn.Linear` of a CPU float32 model to
`forward` here; a layer on another device or dtype, or with more rows, takes torch's path
on every call, so a model moved or cast later stays correct. Quantized layers (int8, int4)
are other module types and keep their own kernels; a LoRA wrapper calls its base layer,
which goes through here.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from backends.llm.cpu_kernels import (
    load_native,
    raise_for_status,
    switched_off,
    torch_uses_gnu_openmp,
)
from backends.llm.kernel_settings import KernelSettings

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "linear.c"
# Rows (tokens) up to which the kernel runs; more go to torch. On the benchmark Llama's
# shapes the kernel is ahead of torch up to 8 rows and level with it at 16
# (docs/benchmarks.md: One stream at a time).
MAX_ROWS = 8


class LinearKernel:
    """`csrc/linear.c`'s `hub_linear_f32` with the checks ctypes cannot make."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        fn = library.hub_linear_f32
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn
        self.threaded = bool(library.hub_linear_threaded())

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`F.linear(x, weight, bias)` for contiguous float32 CPU tensors; x's last dim is
        `in_features`, any leading dims."""
        out_features, in_features = weight.shape
        if x.shape[-1] != in_features:
            raise ValueError(f"linear: input has {x.shape[-1]} features, weight {in_features}")
        if bias is not None and bias.shape != (out_features,):
            raise ValueError("linear: bias shape does not match the weight's rows")
        rows = x.numel() // in_features
        y = torch.empty((*x.shape[:-1], out_features), dtype=torch.float32)
        status = self._fn(
            x.data_ptr(),
            rows,
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            in_features,
            out_features,
            torch.get_num_threads(),
        )
        raise_for_status("linear", status)
        return y


@functools.cache
def linear_kernel(settings: KernelSettings = KernelSettings()) -> LinearKernel | None:
    """The kernel (the install's build, or compiled on first use); None where no library
    loads (a WARNING, once per settings: the slow path), `settings` switch it off, or only a
    serial build loads (one core: no faster than torch's)."""
    if not settings.enabled:
        switched_off(SOURCE.stem)
        return None
    try:
        kernel = load_native(
            SOURCE, LinearKernel, openmp=torch_uses_gnu_openmp(), settings=settings
        )
    except (RuntimeError, ValueError) as e:
        log.warning("slow path: linear layers run in torch, no native kernel loads: %s", e)
        return None
    if not kernel.threaded:
        log.info("native linear kernel built without OpenMP; linear layers run in torch")
        return None
    return kernel


def _forward(kernel: LinearKernel, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight, bias = module.weight, module.bias
    if (
        x.dtype is torch.float32
        and weight.dtype is torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.numel() <= MAX_ROWS * module.in_features
        and weight.is_contiguous()
        and (bias is None or (bias.dtype is torch.float32 and bias.is_contiguous()))
        and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
    ):
        return kernel(x.contiguous(), weight, bias)
    return F.linear(x, weight, bias)


def install(model: torch.nn.Module, settings: KernelSettings = KernelSettings()) -> int:
    """Route `model`'s plain linear layers through the kernel at up to `MAX_ROWS` rows;
    returns how many (0 where the kernel is unavailable)."""
    kernel = linear_kernel(settings)
    if kernel is None:
        return 0
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(functools.partial(_forward, kernel), module)  # type: ignore[method-assign]
            count += 1
    return count
