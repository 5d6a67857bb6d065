"""The batched LoRA matmul: one step, many adapters, each token its own (or none).

Contract: `LoRALinear` wraps a target linear layer of the stock transformers model (an
`nn.Linear` or an int8 `Int8Linear`); the base output is computed once for the whole packed
batch and the low-rank delta is added per token. What the delta needs comes from the step's
`LoRABatch`, which the runner sets on the shared `LoRAContext` around the forward; with no
batch set (a step of the base alone) the wrapper is the base layer plus one attribute read.

How the delta is computed (S-LoRA's batched gather-matmul, in plain torch): the step's
tokens are grouped by adapter into a padded `(k, L)` index (k adapters that target the
module, L the most tokens any of them has; padding points at token 0), gathered in one
`index_select`, multiplied by the stacked `A` `(k, in, r)` and `B` `(k, r, out)` in two
`bmm`s, and added back onto the base output in one `index_add_`. Padding rows are zeroed
before the second `bmm`, so they add exactly nothing; base tokens are never gathered, so
their output is the base's exactly. Each token costs its own adapter's rank only; a dense
alternative (every token times every adapter's columns, masked: one matmul each way) does k
times that work, about 40% on top of the layers' FLOPs with 8 adapters of rank 16 on the 26M
benchmark Llama, against about 5% here (throughput: docs/benchmarks.md, LoRA).
The stacks are built once per set of adapters and reused
while the set stays; the gather index once per step and pattern of adapters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class StackedLoRA:
    """One module's adapters of a step, stacked (ranks padded with zeros to the largest)."""

    a: torch.Tensor  # (k, in, r)
    b: torch.Tensor  # (k, r, out), scaling folded in
    # Which of the step's adapters (indices into its adapter list) these are, in stack order.
    members: tuple[int, ...]


@dataclass(frozen=True)
class Gather:
    """The step's tokens of some adapters, grouped: row i of the `(k, L)` layout holds the
    packed indices of adapter `members[i]`'s tokens, padded with index 0."""

    index: torch.Tensor  # (k * L,) long
    # (k, L, 1) in the model's dtype, 0 at padding; None when nothing is padded.
    keep: torch.Tensor | None
    width: int  # L


@dataclass
class LoRABatch:
    """What one step's LoRA layers read: the runs of packed tokens per adapter and, per module
    name, the stacked weights of the step's adapters that target it."""

    # Runs of packed tokens in order: (index into the step's adapters or -1 for the base, count).
    segments: list[tuple[int, int]]
    stacks: dict[str, StackedLoRA]
    dtype: torch.dtype
    device: torch.device
    # Built on first use per set of members, shared by the modules with the same adapters.
    _gathers: dict[tuple[int, ...], Gather] = field(default_factory=dict)

    def gather(self, members: tuple[int, ...]) -> Gather:
        found = self._gathers.get(members)
        if found is None:
            found = self._gathers[members] = self._build(members)
        return found

    def _build(self, members: tuple[int, ...]) -> Gather:
        rows: dict[int, list[int]] = {m: [] for m in members}
        start = 0
        for owner, count in self.segments:
            if owner in rows:
                rows[owner].extend(range(start, start + count))
            start += count
        width = max(len(r) for r in rows.values())
        index = [i for m in members for i in rows[m] + [0] * (width - len(rows[m]))]
        keep = None
        if any(len(r) < width for r in rows.values()):
            flags = [[[float(j < len(rows[m]))] for j in range(width)] for m in members]
            keep = torch.tensor(flags, dtype=self.dtype, device=self.device)
        return Gather(torch.tensor(index, device=self.device), keep, width)


class LoRAContext:
    """The step's `LoRABatch`, shared by the runner (which sets it around a forward) and every
    `LoRALinear` of one model; None outside a step and in steps of the base alone."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRALinear(torch.nn.Module):
    """A target linear layer plus the per-token LoRA delta of the step's adapters."""

    def __init__(self, name: str, base_layer: torch.nn.Module, context: LoRAContext) -> None:
        super().__init__()
        self.name = name
        self.base_layer = base_layer
        self.in_features = int(getattr(base_layer, "in_features"))  # noqa: B009
        self.out_features = int(getattr(base_layer, "out_features"))  # noqa: B009
        self._context = context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base_layer(x)
        batch = self._context.batch
        if batch is None:
            return out
        stacked = batch.stacks.get(self.name)
        if stacked is None:  # no adapter of this step targets this layer
            return out
        gather = batch.gather(stacked.members)
        k = len(stacked.members)
        rows = x.reshape(-1, self.in_features)  # (T, in)
        grouped = rows.index_select(0, gather.index).view(k, gather.width, self.in_features)
        low_rank = torch.bmm(grouped, stacked.a)  # (k, L, r)
        if gather.keep is not None:
            low_rank *= gather.keep
        delta = torch.bmm(low_rank, stacked.b)  # (k, L, out)
        out = out.contiguous()
        out.view(-1, self.out_features).index_add_(
            0, gather.index, delta.view(-1, self.out_features)
        )
        return out

    def extra_repr(self) -> str:
        return f"name={self.name}"


def wrap_linear(model: torch.nn.Module, name: str, context: LoRAContext) -> LoRALinear:
    """Replace the module `name` of `model` by a `LoRALinear` around it (once; a module
    already wrapped is returned as is). ValueError when it is not a linear layer."""
    module = model.get_submodule(name)
    if isinstance(module, LoRALinear):
        return module
    if not all(hasattr(module, a) for a in ("in_features", "out_features")):
        raise ValueError(f"{name} is a {type(module).__name__}, not a linear layer")
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    wrapper = LoRALinear(name, module, context)
    setattr(parent, child, wrapper)
    return wrapper
