"""int4 weight-only linear layers on torch's own CPU kernel (`quantization: int4`).

Contract: `Int4Linear` holds a weight quantized to 4 bits in groups of `group_size` input
channels (asymmetric: a bfloat16 scale and zero point per group and output channel), packed
by `aten._convert_weight_to_int4pack_for_cpu` into the layout `aten._weight_int4pack_mm_for_cpu`
reads: `(out, in / 2)` bytes plus `(in / group_size, out, 2)` bfloat16 scales and zeros, both
plain buffers (measured by `module_bytes`, parked like any weights). `int4_fits` says which
shapes the kernel takes (out a multiple of 16, in a multiple of the group size); the caller
stores the others as int8. `require_int4_kernel` raises a LoadError a user can act on where
this torch or device has no such kernel.

How it runs: activations go through the kernel in bfloat16 (in float32 it has no vectorised
path: far slower), the output is cast back to the activations' dtype. Its speed against
float32's by rows is in docs/benchmarks.md (Quantization).
"""

from __future__ import annotations

import functools

import torch

from backends.errors import LoadError

GROUP_SIZES = (32, 64, 128, 256)
# The kernel's packing takes output widths in steps of 16.
_OUT_MULTIPLE = 16


def row_chunks(rows: int, width: int) -> list[slice]:
    """Row ranges of an `(rows, width)` weight to quantize one at a time: multiples of 64 rows
    of about 256K elements. The float temporaries of a chunk stay small enough for the
    allocator to reuse, where whole-matrix temporaries would be left fragmenting the heap
    (glibc keeps freed blocks between live ones), so the load's peak is the quantized size."""
    step = max(64, (2**18 // max(width, 1)) // 64 * 64)
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def int4_fits(shape: tuple[int, ...] | list[int], group_size: int) -> bool:
    """Whether an `(out, in)` weight can be stored as int4 in groups of `group_size`."""
    out_features, in_features = shape
    return out_features % _OUT_MULTIPLE == 0 and in_features % group_size == 0


def int4_bytes(shape: tuple[int, ...] | list[int], group_size: int) -> int:
    """Bytes an `(out, in)` weight takes as int4: packed nibbles plus scales and zeros."""
    out_features, in_features = shape
    return out_features * in_features // 2 + (in_features // group_size) * out_features * 4


@functools.cache
def _kernel_error() -> str | None:
    """Why torch's CPU int4 kernel cannot run here (None: it runs); tried once on a tiny
    weight, since an op can be declared and still fail on a CPU it was not built for."""
    ops = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")
    missing = [op for op in ops if not hasattr(torch.ops.aten, op)]
    if missing:
        return f"torch {torch.__version__} has no aten.{missing[0]}"
    try:
        weight = torch.zeros(16, 32, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight, 1)
        scales = torch.ones(1, 16, 2, dtype=torch.bfloat16)
        x = torch.ones(1, 32, dtype=torch.bfloat16)
        torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales)
    except Exception as e:  # a kernel missing for this CPU fails here, not at the first step
        return f"torch {torch.__version__}'s CPU int4 kernel fails here: {e}"
    return None


def require_int4_kernel(device: str | torch.device) -> None:
    """Raise LoadError unless int4 layers can run on `device` with this torch."""
    if torch.device(device).type != "cpu":
        raise LoadError(
            f"quantization: int4 runs on the CPU only (torch's packed int4 layout is the CPU "
            f"kernel's); this model is placed on {device}: use int8 or none there"
        )
    error = _kernel_error()
    if error is not None:
        raise LoadError(f"quantization: int4 is not available: {error}; use int8")


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` (out, in) as the kernel's packed int4 and its `(in / group, out, 2)` scales
    and zeros: per group, 16 levels spread from its minimum to its maximum. Done in chunks of
    64 rows (the packing's own block: packed chunks concatenate to the whole's packing) so
    the float temporaries stay small while loading."""
    out_features, in_features = weight.shape
    packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8)
    scales = torch.empty(in_features // group_size, out_features, 2, dtype=torch.bfloat16)
    chunks = row_chunks(out_features, in_features) if out_features % 64 == 0 else [slice(None)]
    for rows in chunks:
        packed[rows], scales[:, rows] = _quantize_rows(weight[rows], group_size)
    return packed, scales


def _quantize_rows(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    out_features, in_features = weight.shape
    groups = weight.to(torch.float32, copy=True)  # worked on in place, never written through
    groups = groups.reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    # Rounded to bfloat16 first, so the levels are those the kernel reconstructs.
    scale = ((high - low) / 15).clamp_min(1e-8).to(torch.bfloat16).float()
    # The kernel computes (q - 8) * scale + zero.
    zero = (low + 8 * scale).to(torch.bfloat16).float()
    levels = groups.sub_(zero).div_(scale).add_(8).round_().clamp_(0, 15).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        levels.reshape(out_features, in_features), 1
    )
    scales_and_zeros = torch.cat([scale, zero], dim=-1).transpose(0, 1)
    return packed, scales_and_zeros.to(torch.bfloat16)


class Int4Linear(torch.nn.Module):
    """A linear layer with a packed int4 weight (groups of `group_size` input channels).

    Built empty (its buffers then assigned from tensors quantized as the checkpoint is read)
    or from a float layer (`from_linear`)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, group_size: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group_size = group_size
        self.weight: torch.Tensor
        self.scales_and_zeros: torch.Tensor
        self.bias: torch.Tensor | None
        # Placeholders on the meta device (no memory): the load assigns the real tensors.
        meta = torch.device("meta")
        packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=meta)
        groups = in_features // group_size
        scales = torch.empty(groups, out_features, 2, dtype=torch.bfloat16, device=meta)
        self.register_buffer("weight", packed)
        self.register_buffer("scales_and_zeros", scales)
        self.register_buffer("bias", torch.empty(out_features, device=meta) if bias else None)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group_size: int) -> Int4Linear:
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            group_size=group_size,
        )
        layer.weight, layer.scales_and_zeros = quantize_int4(linear.weight.detach(), group_size)
        layer.bias = linear.bias.detach() if linear.bias is not None else None
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.weight, self.group_size, self.scales_and_zeros
        ).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4, group_size={self.group_size}"
        )
