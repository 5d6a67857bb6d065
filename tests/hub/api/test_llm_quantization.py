"""`quantization: int8` as an operator sees it: `/admin/models` reports the int8 version's
predicted and measured bytes smaller than float32's by the int8 saving of its linear layers,
and it answers completions."""

from __future__ import annotations

from pathlib import Path

import torch
from fastapi.testclient import TestClient

from backends.llm.quantization import is_quantized_weight
from tests.hub.api.test_embeddings import register

KV = 2 * 2**20


def linear_bytes_fp32(folder: Path) -> int:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return sum(
        p.nbytes
        for name, p in model.named_parameters()
        if is_quantized_weight(name, tuple(p.shape))
    )


def test_admin_models_reports_int8_bytes(client: TestClient, tiny_llm_dir: Path) -> None:
    config = {"kv_cache_bytes": KV, "block_size": 4}
    register(client, "fp32", "llm", tiny_llm_dir, config=config)
    register(client, "int8", "llm", tiny_llm_dir, config={**config, "quantization": "int8"})
    for model in ("fp32", "int8"):
        body = {"model": model, "prompt": "The harbour town", "max_tokens": 4, "temperature": 0}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
    status = {m["name"]: m for m in client.get("/admin/models").json()}
    linear = linear_bytes_fp32(tiny_llm_dir)
    measured_saving = status["fp32"]["measured_bytes"] - status["int8"]["measured_bytes"]
    predicted_saving = status["fp32"]["predicted_bytes"] - status["int8"]["predicted_bytes"]
    # int8 keeps at most 0.35x of the linear layers' float32 bytes.
    assert measured_saving >= 0.65 * linear, (measured_saving, linear)
    assert predicted_saving == measured_saving
