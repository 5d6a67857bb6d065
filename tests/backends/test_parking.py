"""Parking weights in one host buffer: a restore brings back the same model (ties, outside
references and outputs intact) with one copy, none between the CPU and host memory; release
frees tensors without the collector."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from backends.base import BackendContext
from backends.encoders.embedder import EmbedderBackend
from backends.parking import ALIGNMENT, park, release


class TiedNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as in Qwen and Gemma checkpoints
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("ids", torch.arange(7), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(x)) * self.scale)  # type: ignore[no-any-return]


def test_park_and_restore_give_back_the_same_model() -> None:
    torch.manual_seed(0)
    net = TiedNet().eval()
    x = torch.tensor([[1, 2, 3, 9]])
    with torch.no_grad():
        before = net(x)
    head = net.head.weight  # an engine holding on to a weight directly
    distinct = (net.embed.weight, net.norm.weight, net.norm.bias, net.scale, net.ids)
    expected = sum(-(-t.numel() * t.element_size() // ALIGNMENT) * ALIGNMENT for t in distinct)
    parked = park(net)
    # Device memory is released: every tensor is empty until restored.
    assert all(t.numel() == 0 for t in (*net.parameters(), *net.buffers()))
    assert parked.nbytes == expected and not parked.pinned  # the tied weight is stored once
    # Onto the CPU nothing is copied: the host buffer becomes the weights' block.
    assert parked.restore("cpu") == 0
    assert net.head.weight is net.embed.weight is head  # ties and outside references kept
    assert net.ids.tolist() == list(range(7)) and net.ids.dtype == torch.int64
    with torch.no_grad():
        assert torch.equal(net(x), before)
    # The restored weights share one block.
    storages = {t.untyped_storage().data_ptr() for t in net.parameters()}
    assert len(storages) == 1
    with pytest.raises(RuntimeError, match="already restored"):
        parked.restore("cpu")
    # Parking a restored CPU model again takes its block as the buffer: the weights stay
    # where they are through a whole offload and restore, and give the same outputs.
    again = park(net)
    assert again.nbytes == expected
    assert all(t.numel() == 0 for t in (*net.parameters(), *net.buffers()))
    assert again.restore("cpu") == 0
    assert {t.untyped_storage().data_ptr() for t in net.parameters()} == storages
    with torch.no_grad():
        assert torch.equal(net(x), before)
    # Pinned (as weights parked from a GPU are) the buffer is copied back into a new block.
    pinned = park(net, pin_memory=True) if torch.cuda.is_available() else None
    if pinned is not None:
        assert pinned.pinned and pinned.restore("cpu") == expected
        with torch.no_grad():
            assert torch.equal(net(x), before)


def test_park_refuses_a_module_that_was_never_loaded() -> None:
    with torch.device("meta"):
        net = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="meta device"):
        park(net)


def test_release_frees_tensors_even_inside_reference_cycles() -> None:
    net = TiedNet()
    net.me = [net]  # type: ignore[assignment]  # a reference cycle, as real models have
    weight = weakref.ref(net.embed.weight.untyped_storage())
    gc.disable()
    try:
        release(net)
        del net
        assert weight() is None  # freed by reference counting, no collection needed
    finally:
        gc.enable()


def test_embedder_offload_and_restore_keep_its_vectors(tiny_embedder_dir: Path) -> None:
    backend = EmbedderBackend(BackendContext("emb", "1"))
    backend.load(tiny_embedder_dir, "cpu")
    texts = ["a parked model", "comes back the same"]
    before = asyncio.run(backend.embed(texts)).vectors
    size = backend.memory_bytes()
    assert backend.offload_bytes() == size > 0
    backend.offload()
    assert backend.memory_bytes() == 0 and backend.device == "cpu"
    backend.restore("cpu")
    assert backend.memory_bytes() >= size
    np.testing.assert_array_equal(asyncio.run(backend.embed(texts)).vectors, before)
    model = weakref.ref(backend.model)
    backend.unload()
    gc.collect()
    assert model() is None
