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

How it runs on a CPU: a few rows (a decode step) go through torch's int8 matrix-vector kernel
(`aten._weight_int8pack_mm`) with bfloat16 activations, which reads a quarter of float32's
bytes; in float32 that kernel has no vectorised path here (about 10x slower than a float32
matmul), in bfloat16 it has. More rows (prefill chunks, large decode batches) dequantize the
weight to bfloat16 and run one bfloat16 matmul, faster there than the matrix-vector kernel
row by row. Either way the output is rounded through bfloat16. Elsewhere (CUDA) the weight is
dequantized to the activations' dtype for one matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QUANTIZATION_METHODS = ("none", "int8")

# Up to this many rows the int8 matrix-vector kernel beats dequantize + matmul on a CPU.
GEMV_MAX_ROWS = 16
# The int8 kernel reads `in_features` in steps of 16 (other widths crash it): those take the
# dequantizing path.
_KERNEL_IN_MULTIPLE = 16


def is_quantized_weight(name: str, shape: tuple[int, ...] | list[int]) -> bool:
    """Whether the weight `name` (a state-dict or safetensors key) is stored as int8."""
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    parts = name.split(".")
    if any("embed" in p or "norm" in p or p == "wte" for p in parts):
        return False
    # Routed experts and their routers stay in the model's dtype.
    return "experts" not in parts and parts[-2] not in ("gate", "router")


class Int8Linear(torch.nn.Module):
    """A linear layer with an int8 weight and a per-output-channel scale (bfloat16)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scale = weight.abs().amax(dim=1).float().clamp_min(1e-12) / 127.0  # (out,)
        # Rounded to bfloat16 before quantizing, so the stored scale is the one divided by.
        scale = scale.to(torch.bfloat16)
        quantized = torch.round(weight.float() / scale.float()[:, None]).clamp_(-127, 127)
        self.weight: torch.Tensor
        self.scale: torch.Tensor
        self.bias: torch.Tensor | None
        self.register_buffer("weight", quantized.to(torch.int8).contiguous())
        self.register_buffer("scale", scale)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self._kernel_ok = self.in_features % _KERNEL_IN_MULTIPLE == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if x.device.type == "cpu":
            activations = rows.to(torch.bfloat16)
            if rows.shape[0] <= GEMV_MAX_ROWS and self._kernel_ok:
                out = torch.ops.aten._weight_int8pack_mm(activations, self.weight, self.scale)
            else:
                out = F.linear(activations, self.weight.to(torch.bfloat16)) * self.scale
            out = out.to(x.dtype)
        else:
            out = F.linear(rows, self.weight.to(x.dtype)) * self.scale.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_model(model: torch.nn.Module) -> int:
    """Replace the selected `nn.Linear` layers of `model` by `Int8Linear` in place; returns
    how many. Each float weight is freed as soon as its layer is converted."""
    tied = _tied_head(model)
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and is_quantized_weight(f"{name}.weight", tuple(module.weight.shape))
        and module.weight is not tied
    ]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear(getattr(parent, child)))
    return len(names)


def quantized_bytes(name: str, shape: list[int], element_size: int) -> int:
    """Bytes the tensor `name` of `shape` takes once loaded with int8 quantization, where it
    would take `element_size` bytes an element unquantized."""
    numel = 1
    for dim in shape:
        numel *= dim
    if is_quantized_weight(name, shape):
        return numel + 2 * shape[0]  # int8 weight, bfloat16 scale per row
    return numel * element_size


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
