"""A grouped expert matmul for the mixture-of-experts layers of Mixtral, Qwen2-MoE and
Qwen3-MoE, in place of the per-expert loop of transformers' stock experts module.

Contract: `group_experts(model)` rebinds `forward` of every experts module of the stock shape
(`gate_up_proj` `(E, 2I, H)` and `down_proj` `(E, H, I)` parameters, `act_fn`, called with
the hidden states, each token's top-k expert ids and routing weights) to
`grouped_experts_forward`, and returns how many it rebound. The weights are untouched (same
parameters, still parked and measured as before).

How: the (token, slot) pairs are sorted by expert once (a stable sort, so each expert's rows
keep token order), the hidden states gathered once in that order, each expert with tokens
runs two GEMMs on its contiguous slice of rows, the routing weights scale all rows in one
multiply, and one `index_add_` sums them back per token. The stock module instead builds a
one-hot mask of every token against every expert and, per expert hit, finds its rows with
`where`, gathers, multiplies and scatters: several small ops and a device sync per expert.
Each token's contributions are added in expert order, as the stock loop adds them, so the
sums round the same way (tests/backends/llm/test_moe.py).

Not switched on: with torch 2.13 and transformers 5.23 a model loads with transformers'
`grouped_mm` experts implementation (one `grouped_mm` call per projection, CPU kernel
included), not the loop, and this is not reliably faster than that at decode sizes on this
CPU (benchmarks/moe_experts.py, 5 rounds: `grouped_mm` takes 1.17x this one's time at 1
token, 1.01x at 32, 1.14x at 256; an earlier run 0.97x, 1.05x, 1.04x). `group_experts` is
kept for a transformers or configuration that falls back to the loop ("eager").
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def grouped_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts module's output for `hidden_states` (T, H): the routing-weighted sum of
    each token's top-k experts."""
    gate_up_proj: torch.Tensor = self.gate_up_proj  # type: ignore[assignment]
    down_proj: torch.Tensor = self.down_proj  # type: ignore[assignment]
    num_experts = gate_up_proj.shape[0]
    top_k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # One host read for all the experts' row counts (the stock loop syncs once per expert).
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // top_k
    rows = hidden_states.index_select(0, tokens)
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts[:num_experts]):
        if count == 0:
            continue
        end = start + count
        gate, up = F.linear(rows[start:end], gate_up_proj[expert]).chunk(2, dim=-1)
        out[start:end] = F.linear(self.act_fn(gate) * up, down_proj[expert])  # type: ignore[operator]
        start = end
    out[start:] = 0  # rows routed to no local expert (an id past the last) add nothing
    out.mul_(top_k_weights.reshape(-1).index_select(0, order)[:, None].to(out.dtype))
    return torch.zeros_like(hidden_states).index_add_(0, tokens, out)


def _is_stock_experts(module: torch.nn.Module) -> bool:
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (
        type(module).__name__.endswith("Experts")
        and isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.dim() == 3
        and down.dim() == 3
        and hasattr(module, "act_fn")
        and not getattr(module, "has_bias", False)
    )


def group_experts(model: torch.nn.Module) -> int:
    """Rebind the stock experts modules of `model` to the grouped forward; returns how many."""
    count = 0
    for module in model.modules():
        if _is_stock_experts(module):
            module.forward = types.MethodType(grouped_experts_forward, module)
            count += 1
    return count
