"""The grouped expert matmul (`backends.llm.moe`), measured against transformers' experts
implementations by benchmarks/moe_experts.py and not switched on (transformers' own
`grouped_mm`, the default a model loads with here, is as fast): it computes what
transformers' per-expert loop computes, for Mixtral's and Qwen3-MoE's experts modules."""

from __future__ import annotations

import types

import pytest
import torch

from backends.llm.moe import group_experts, grouped_experts_forward
from backends.tiny.llm import tiny_llm_config


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@torch.inference_mode()
def test_grouped_experts_equal_transformers_loop(arch: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llm_config(arch))
    experts = model.model.layers[0].mlp.experts
    experts.config._experts_implementation = "eager"
    num_experts = experts.gate_up_proj.shape[0]
    hidden = torch.randn(9, experts.gate_up_proj.shape[-1])
    weights, index = torch.topk(torch.randn(9, num_experts).softmax(-1), 2, dim=-1)
    index[0, 1] = num_experts  # a slot routed to no local expert adds nothing
    expected = experts(hidden, index, weights)
    grouped = types.MethodType(grouped_experts_forward, experts)(hidden, index, weights)
    assert torch.allclose(grouped, expected, atol=1e-6)
    assert group_experts(model) == model.config.num_hidden_layers
