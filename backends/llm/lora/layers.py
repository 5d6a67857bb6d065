"""The batched LoRA matmul: one step, many adapters, each token its own (or none).

Contract: `LoRALinear` wraps a target linear layer of the stock transformers model (an
`nn.Linear` or an int8 `Int8Linear`); the base output is computed once for the whole packed
batch and the low-rank delta is added per token. What the delta needs comes from the step's
`LoRABatch`, which the runner sets on the shared `LoRAContext` around the forward; with no
batch set (a step of the base alone) the wrapper is the base layer plus one attribute read.

How the delta is computed (S-LoRA's idea in plain torch, with no per-token gather): the
step's adapters that target a module are stacked along the rank, `A` as `(R, in)` and the
scaled `B` as `(R, out)` with `R` the sum of their ranks, so every token's rank-space
activations for every adapter come out of one matmul `(T, in) x (in, R)`. A 0/1 mask
`(T, R)` keeps each token's own adapter's columns (a base token keeps none, so its output
is the base's exactly), and one more matmul `(T, R) x (R, out)` adds the delta. Two small
dense matmuls beat a Python loop over adapters or per-token gathers of `A` and `B` at the
sizes this serves (R = adapters x rank, far below the layer's width); the stacks are built
once per set of adapters and reused while the set stays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class StackedLoRA:
    """One module's adapters of a step, stacked: token rows select their columns."""

    a: torch.Tensor  # (R, in)
    b: torch.Tensor  # (R, out), scaling folded in
    # Modules whose columns belong to the same adapters share a pattern number (and mask).
    pattern: int
    # (R,) long: which of the step's adapters owns each rank column.
    owners: torch.Tensor


@dataclass
class LoRABatch:
    """What one step's LoRA layers read: the adapter of every packed token and, per module
    name, the stacked weights of the step's adapters that target it."""

    # (T,) long: index into the step's adapter list, -1 for a base token.
    token_adapter: torch.Tensor
    stacks: dict[str, StackedLoRA]
    dtype: torch.dtype
    # Column masks per owners pattern, built on first use and shared by the modules that
    # have the same adapters (all q_proj and v_proj of every layer, say).
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask(self, stacked: StackedLoRA) -> torch.Tensor:
        """(T, R) in the model's dtype: 1 where column r belongs to token t's adapter."""
        mask = self._masks.get(stacked.pattern)
        if mask is None:
            owners = stacked.owners
            mask = (self.token_adapter[:, None] == owners[None, :]).to(self.dtype)
            self._masks[stacked.pattern] = mask
        return mask


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
        rows = x.reshape(-1, self.in_features)  # (T, in)
        low_rank = torch.matmul(rows, stacked.a.t())  # (T, R)
        low_rank *= batch.mask(stacked)
        delta = torch.addmm(out.reshape(-1, self.out_features), low_rank, stacked.b)
        return delta.view(out.shape)

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
