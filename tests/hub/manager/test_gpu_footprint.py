"""Footprints on a GPU: what a load allocates there (each tensor as the CUDA caching
allocator rounds it; no flat allowance per model), while the CPU prediction stays as it was.
The arithmetic runs on shapes; the `cuda` test holds it against a real load's growth."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from backends.encoders.embedder import EmbedderBackend
from backends.kinds import ModelKind
from backends.llm.backend import LLMBackend
from backends.loading import HeaderTensor, cuda_allocation_bytes, tensor_bytes
from backends.runtime_config import config_type
from hub.manager.devices import Device
from hub.manager.footprint import Footprint
from hub.manager.loader import PreparedVersion

KiB, MiB = 2**10, 2**20


def test_the_allocator_rounds_small_tensors_to_blocks_and_large_to_segments() -> None:
    assert cuda_allocation_bytes(0) == 0
    assert cuda_allocation_bytes(1) == 512
    assert cuda_allocation_bytes(512) == 512
    assert cuda_allocation_bytes(513) == 1024
    assert cuda_allocation_bytes(MiB) == MiB
    assert cuda_allocation_bytes(MiB + 1) == 2 * MiB
    assert cuda_allocation_bytes(5 * MiB) == 6 * MiB
    assert cuda_allocation_bytes(8 * MiB) == 8 * MiB


def test_tensor_bytes_on_cuda_count_each_tensor_as_allocated() -> None:
    tensors = [
        HeaderTensor("norm.weight", "F32", [100]),  # 400 bytes -> one 512-byte block
        HeaderTensor("embed.weight", "BF16", [1000, 600]),  # 1.2 MB -> a 2 MiB step
        HeaderTensor("position_ids", "I64", [1, 3]),  # 24 bytes -> 512
    ]
    assert tensor_bytes(tensors) == 400 + 1_200_000 + 24
    assert tensor_bytes(tensors, device="cuda:0") == 512 + 2 * MiB + 512
    # Cast to float32 first, then rounded: 2.4 MB -> 4 MiB.
    assert tensor_bytes(tensors, torch.float32, device="cuda:1") == 512 + 4 * MiB + 512


def prepared(kind: str, folder: Path, config: dict[str, Any]) -> PreparedVersion:
    backend = EmbedderBackend if kind == "embedder" else LLMBackend
    typed = config_type(ModelKind(kind)).model_validate(config)
    return PreparedVersion(view=None, artifact_dir=folder, backend_cls=backend, config=typed)  # type: ignore[arg-type]


def test_a_tiny_embedder_is_charged_its_weights_on_a_gpu(tiny_embedder_dir: Path) -> None:
    weights = sum(p.stat().st_size for p in tiny_embedder_dir.glob("*.safetensors"))
    footprint = Footprint([Device("cpu", 4096 * MiB), Device("cuda:0", 4096 * MiB, 512 * MiB)])
    need = footprint.predict(prepared("embedder", tiny_embedder_dir, {}),
                             {"cpu": 4096 * MiB, "cuda:0": 3584 * MiB})  # fmt: skip
    # The CPU keeps its allowance for activations and the tokenizer.
    assert need["cpu"] == EmbedderBackend.predict_memory(tiny_embedder_dir, {})
    assert need["cpu"] > 32 * MiB
    # On the GPU: the weights in float16 (half the float32 checkpoint), each rounded up by at
    # most one block or segment step.
    assert weights / 2 <= need["cuda:0"] < weights / 2 + 2 * MiB * 8
    assert need["cuda:0"] < need["cpu"] / 10


def test_an_llm_on_a_gpu_keeps_its_kv_cache_and_drops_the_cpu_scratch(tiny_llm_dir: Path) -> None:
    config = {"kv_cache_bytes": 16 * MiB, "fused_step": True}
    cpu = LLMBackend.predict_memory(tiny_llm_dir, config)
    gpu = LLMBackend.predict_memory(tiny_llm_dir, config, device="cuda:0")
    assert gpu >= 16 * MiB
    no_scratch = LLMBackend.predict_memory(tiny_llm_dir, {**config, "fused_step": False})
    assert gpu >= no_scratch  # rounding only ever adds to the weights
    assert cpu >= no_scratch


@pytest.mark.cuda
def test_a_gpu_prediction_covers_the_measured_growth(tiny_embedder_dir: Path) -> None:
    before = torch.cuda.memory_allocated(0)
    # The checkpoint's float32, as `load_file` below keeps it.
    predicted = EmbedderBackend.predict_memory(
        tiny_embedder_dir, {"dtype": "float32"}, device="cuda:0"
    )
    model = torch.nn.Module()
    from safetensors.torch import load_file

    for path in tiny_embedder_dir.glob("*.safetensors"):
        for name, tensor in load_file(path, device="cuda:0").items():
            model.register_buffer(name.replace(".", "_"), tensor)
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated(0) - before
    assert grown <= predicted <= grown * 1.1 + 2 * MiB
    del model
