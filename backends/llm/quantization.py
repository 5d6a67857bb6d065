"""int8 weight-only quantization of an LLM's linear layers, applied at load.

Contract: `quantize_model(model)` replaces every `nn.Linear` that `is_quantized_weight` selects
with an `Int8Linear`: its weight as int8 `(out, in)` with one scale per output channel
(symmetric, absmax / 127), both plain buffers, so `module_bytes` measures them as int8 and
`backends.parking` parks and restores them like any other weights. `quantized_bytes` predicts
the same footprint from safetensors headers alone, with the same selection rule.

What is quantized: the attention and MLP projections of every layer (shared experts
included) and an untied LM head. What is not: embeddings and norms (small, and
precision-sensitive), a head tied to the embeddings (quantizing it would add a second copy,
not save one), the routers of mixture-of-experts layers, and their routed experts (3-D
tensors, not `nn.Linear`; they stay in the model's dtype). The LM head is quantized because
it is one of the largest matrices of a small model (vocabulary x hidden) and the largest
single read of a decode step; its error is measured with the rest (top-1 agreement in
tests/backends/llm/test_quantization.py).

How it runs on a CPU: a float32 model of the Llama family runs its steps in the fused CPU
kernel (backends/llm/fused), which reads the int8 weights and their scales itself. Through
this module (other architectures, long prompt chunks): a few rows (a decode step) go through
torch's int8 matrix-vector kernel (`aten._weight_int8pack_mm`) with bfloat16 activations,
which reads a quarter of float32's bytes; in float32 that kernel has no vectorised path
(about 10x slower than a float32 matmul), in bfloat16 it has. More rows (prefill chunks,
large decode batches) dequantize the weight for one matmul: in bfloat16 where the CPU has
bfloat16 units, else in float32 (an emulated bfloat16 matmul is several times slower). The
output is rounded through bfloat16 except on that last path. Elsewhere (CUDA) the weight is
dequantized to the activations' dtype for one matmul.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backends.llm.int4 import Int4Linear, int4_bytes, int4_fits, quantize_int4, row_chunks

QUANTIZATION_METHODS = ("none", "int8", "int4")

# Up to this many rows the int8 matrix-vector kernel beats dequantize + matmul on a CPU.
GEMV_MAX_ROWS = 16
# The int8 kernel reads `in_features` in steps of 16 (other widths crash it): those take the
# dequantizing path.
_KERNEL_IN_MULTIPLE = 16


_reference = threading.local()


@contextlib.contextmanager
def float32_reference() -> Iterator[None]:
    """Within the block, on the calling thread, `Int8Linear` computes in float32 with its
    dequantized weights (int8 times scale) instead of its bfloat16 kernels: the exact
    product of the stored weights, what the fused CPU step is checked against."""
    before = getattr(_reference, "on", False)
    _reference.on = True
    try:
        yield
    finally:
        _reference.on = before


@functools.cache
def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX). Without, a
    bfloat16 matmul is emulated, several times slower than float32
    (docs/benchmarks.md: LLM throughput)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def is_quantized_weight(name: str, shape: tuple[int, ...] | list[int]) -> bool:
    """Whether the weight `name` (a state-dict or safetensors key) is stored as int8."""
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    parts = name.split(".")
    if any("embed" in p or "norm" in p or p == "wte" for p in parts):
        return False
    # Routed experts and their routers stay in the model's dtype.
    return "experts" not in parts and parts[-2] not in ("gate", "router")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` (out, in) as int8 with one bfloat16 scale per output channel (absmax / 127)."""
    out_features, in_features = weight.shape
    quantized = torch.empty(out_features, in_features, dtype=torch.int8, device=weight.device)
    scale = torch.empty(out_features, dtype=torch.bfloat16, device=weight.device)
    for rows in row_chunks(out_features, in_features):
        chunk = weight[rows].to(torch.float32, copy=True)  # never written through
        # Rounded to bfloat16 before quantizing, so the stored scale is the one divided by.
        chunk_scale = (chunk.abs().amax(dim=1).clamp_min(1e-12) / 127.0).to(torch.bfloat16)
        chunk.div_(chunk_scale.float()[:, None]).round_().clamp_(-127, 127)
        quantized[rows] = chunk.to(torch.int8)
        scale[rows] = chunk_scale
    return quantized, scale


class Int8Linear(torch.nn.Module):
    """A linear layer with an int8 weight and a per-output-channel scale (bfloat16).

    Built empty (`Int8Linear(in, out, bias=...)`, its buffers then assigned from quantized
    checkpoint tensors as they are read) or from a float layer (`from_linear`)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight: torch.Tensor
        self.scale: torch.Tensor
        self.bias: torch.Tensor | None
        # Placeholders on the meta device (no memory): the load assigns the real tensors.
        self.register_buffer(
            "weight", torch.empty(out_features, in_features, dtype=torch.int8, device="meta")
        )
        self.register_buffer(
            "scale", torch.empty(out_features, dtype=torch.bfloat16, device="meta")
        )
        self.register_buffer("bias", torch.empty(out_features, device="meta") if bias else None)
        self._kernel_ok = self.in_features % _KERNEL_IN_MULTIPLE == 0

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Int8Linear:
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        layer.weight, layer.scale = quantize_int8(linear.weight.detach())
        layer.bias = linear.bias.detach() if linear.bias is not None else None
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if getattr(_reference, "on", False):
            weight = self.weight.to(x.dtype) * self.scale.to(x.dtype)[:, None]
            out = F.linear(rows, weight)
        elif x.device.type == "cpu" and rows.shape[0] <= GEMV_MAX_ROWS and self._kernel_ok:
            activations = rows.to(torch.bfloat16)
            out = torch.ops.aten._weight_int8pack_mm(activations, self.weight, self.scale)
            out = out.to(x.dtype)
        elif x.device.type == "cpu" and native_bfloat16():
            out = F.linear(rows.to(torch.bfloat16), self.weight.to(torch.bfloat16)) * self.scale
            out = out.to(x.dtype)
        elif x.device.type == "cpu":  # no bfloat16 units: a float32 product is far faster
            weight = self.weight.to(torch.float32) * self.scale.to(torch.float32)[:, None]
            out = F.linear(rows.to(torch.float32), weight).to(x.dtype)
        else:
            out = F.linear(rows, self.weight.to(x.dtype)) * self.scale.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


@dataclass(frozen=True)
class WeightQuantizer:
    """Which weights of a model are quantized and how, applied either to a loaded model
    (`apply`) or tensor by tensor while its checkpoint is read (`prepare` + `convert`, the
    `backends.loading.WeightTransform` protocol): then no float copy of the model exists at
    any time, only the tensor being converted.

    `method` "int4" stores the layers whose shape the int4 kernel takes (`int4_fits`) as
    `Int4Linear` in groups of `group_size`, the others as int8."""

    method: str = "int8"
    group_size: int = 128

    def layer_count(self, model: torch.nn.Module) -> int:
        return sum(isinstance(m, Int8Linear | Int4Linear) for m in model.modules())

    def apply(self, model: torch.nn.Module) -> int:
        """Replace the selected `nn.Linear` layers of a loaded `model` in place; returns how
        many. Each float weight is freed as soon as its layer is converted."""
        names = self._selected(model)
        for name in names:
            parent, child = _parent(model, name)
            linear = getattr(parent, child)
            if self._int4(tuple(linear.weight.shape)):
                layer: torch.nn.Module = Int4Linear.from_linear(linear, self.group_size)
            else:
                layer = Int8Linear.from_linear(linear)
            setattr(parent, child, layer)
        return len(names)

    def prepare(self, model: torch.nn.Module) -> set[str]:
        """Swap the selected layers of a just-built `model` for empty quantized ones; returns
        the names of the checkpoint weights `convert` quantizes."""
        names = self._selected(model)
        for name in names:
            parent, child = _parent(model, name)
            linear = getattr(parent, child)
            sizes = (linear.in_features, linear.out_features)
            bias = linear.bias is not None
            if self._int4(tuple(linear.weight.shape)):
                layer: torch.nn.Module = Int4Linear(*sizes, bias=bias, group_size=self.group_size)
            else:
                layer = Int8Linear(*sizes, bias=bias)
            setattr(parent, child, layer)
        return {f"{name}.weight" for name in names}

    def convert(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The quantized layer's buffers for the float weight `name` (one `prepare` named)."""
        layer = name.removesuffix(".weight")
        # Quantized from the checkpoint's own (mapped) memory.
        if self._int4(tuple(tensor.shape)):
            packed, scales = quantize_int4(tensor, self.group_size)
            return {name: packed, f"{layer}.scales_and_zeros": scales}
        weight, scale = quantize_int8(tensor)
        return {name: weight, f"{layer}.scale": scale}

    def tensor_bytes(self, name: str, shape: list[int], element_size: int) -> int:
        """Bytes the tensor `name` of `shape` takes once loaded, where it would take
        `element_size` bytes an element unquantized (`tensor_bytes_from_headers`'s size_of)."""
        if self.stores_int4(name, shape):
            return int4_bytes(shape, self.group_size)
        return quantized_bytes(name, shape, element_size)

    def stores_int4(self, name: str, shape: list[int]) -> bool:
        """Whether the tensor `name` of `shape` is stored as int4 once loaded."""
        return is_quantized_weight(name, shape) and self._int4(tuple(shape))

    def _int4(self, shape: tuple[int, ...]) -> bool:
        return self.method == "int4" and int4_fits(shape, self.group_size)

    def _selected(self, model: torch.nn.Module) -> list[str]:
        tied = _tied_head(model)
        return [
            name
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)
            and is_quantized_weight(f"{name}.weight", tuple(module.weight.shape))
            and module.weight is not tied
        ]


def quantize_model(model: torch.nn.Module) -> int:
    """Replace the selected `nn.Linear` layers of a loaded `model` by `Int8Linear` in place;
    returns how many."""
    return WeightQuantizer().apply(model)


def quantized_bytes(name: str, shape: list[int], element_size: int) -> int:
    """Bytes the tensor `name` of `shape` takes once loaded with int8 quantization, where it
    would take `element_size` bytes an element unquantized."""
    numel = 1
    for dim in shape:
        numel *= dim
    if is_quantized_weight(name, shape):
        return numel + 2 * shape[0]  # int8 weight, bfloat16 scale per row
    return numel * element_size


def _parent(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    parent_name, _, child = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


def _tied_head(model: torch.nn.Module) -> torch.Tensor | None:
    """The output head's weight when it is the input embedding's, else None."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return None
    head, embedding = get_out(), get_in()
    if head is None or embedding is None or head.weight is not embedding.weight:
        return None
    weight: torch.Tensor = head.weight
    return weight
