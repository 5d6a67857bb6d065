"""An encoder's stages packed for a forward worker process (backends/encoders/forward_process.py).

The weights go as one block of shared memory (`backends.parking.share` lays the module out in
it, one copy) and the rest of the stages (modules, tokenizer, packed-attention helpers) as a
pickle in which every tensor that is a view of the block is named by its place in it, not
copied. One handle crosses to the worker however many tensors the model has: multiprocessing
passes at most 252 with a new process, and a large encoder has more. The worker rebuilds each
weight as a view of its mapping of the block, so every worker and the hub hold the same pages.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from backends.parking import share


@dataclass(frozen=True)
class PackedStages:
    """An encoder's stages for a worker: its weights as one block of shared memory (one
    handle to send, however many tensors the model has: multiprocessing passes at most 252
    with a new process) and the rest pickled, each weight named by where it lies in the
    block."""

    block: torch.Tensor  # uint8, shared
    pickled: bytes

    def unpack(self) -> Any:
        return _BlockUnpickler(io.BytesIO(self.pickled), self.block).load()


def pack_stages(stages: Any) -> PackedStages:
    """Move the stages' model into shared memory (`backends.parking.share`) and pickle the
    stages against it."""
    block = share(stages.model)
    out = io.BytesIO()
    _BlockPickler(out, block).dump(stages)
    return PackedStages(block, out.getvalue())


class _BlockPickler(pickle.Pickler):
    """Pickles tensors that are views of `block` as their place in it."""

    def __init__(self, file: io.BytesIO, block: torch.Tensor) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._storage = block.untyped_storage().data_ptr()

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
            return None
        if obj.untyped_storage().data_ptr() != self._storage:
            return None  # not a weight (small, pickled by value)
        offset = obj.storage_offset() * obj.element_size()
        parameter = isinstance(obj, torch.nn.Parameter)
        return ("weight", offset, obj.dtype, tuple(obj.shape), tuple(obj.stride()), parameter,
                obj.requires_grad)  # fmt: skip


class _BlockUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, block: torch.Tensor) -> None:
        super().__init__(file)
        self._storage = block.untyped_storage()

    def persistent_load(self, pid: Any) -> Any:
        _, offset, dtype, shape, stride, parameter, requires_grad = pid
        size = torch.empty(0, dtype=dtype).element_size()
        view = torch.empty(0, dtype=dtype).set_(self._storage, offset // size, shape, stride)
        if parameter:
            return torch.nn.Parameter(view, requires_grad=requires_grad)
        return view
