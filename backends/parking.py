"""Parking a module's weights in host memory, and bringing them back with one copy.

Contract: `park(module)` copies every parameter and buffer of `module` into one contiguous
host buffer (page-locked when the weights come from a CUDA device, so the copies back run at
full PCIe speed), then releases the originals: each tensor keeps its Python identity but holds
no memory until restored. `ParkedWeights.restore(device)` allocates one block on `device`,
copies the whole buffer into it in one transfer, and rebinds every tensor to its slice, so a
restore costs one allocation and one copy of `nbytes` bytes, no more. Between the CPU and
host memory (the same memory) nothing is copied at all: a restore onto the CPU rebinds the
tensors to the (unpinned) buffer itself, and parking CPU weights that a restore laid out in
one block takes that block as the buffer. Tied weights (one
tensor reachable under two names) and outside references to a parameter (an engine holding
`lm_head.weight`) survive both steps, because the same tensor objects are rebound.

`release(module)` frees a module's tensors in place at unload, without waiting for the
garbage collector. `share(module)` lays a CPU module's tensors out the same way in one block of
shared memory, for worker processes to map (`backends.encoders.forward_process`).

The module must be idle for both steps (the manager guarantees it: nothing is in flight).
Tensors that are not parameters or buffers of the module (caches an engine keeps elsewhere)
are not parked; their owner releases and rebuilds them.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import torch

# Freeing a large buffer unmaps its pages (about 0.1 ms per MiB); a restored model need not
# wait for that, so spent host buffers are dropped on this thread instead.
_freeing = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="parking")

# Every slice starts on a 256-byte boundary: the alignment CUDA's allocator gives every block,
# which vectorised kernels rely on; the padding costs at most 255 bytes per tensor.
ALIGNMENT = 256


@dataclass(frozen=True)
class _Slot:
    """Where one distinct tensor lives in the parked buffer, and the objects to rebind."""

    tensors: tuple[torch.Tensor, ...]  # the parameter/buffer objects sharing this data
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size


class ParkedWeights:
    """A module's weights packed into one host buffer; spent after `restore` or `discard`."""

    def __init__(self, buffer: torch.Tensor, slots: list[_Slot], source_device: torch.device):
        self._buffer: torch.Tensor | None = buffer
        self._slots = slots
        self.source_device = source_device
        self.nbytes = int(buffer.numel())
        self.pinned = bool(buffer.is_pinned()) if buffer.device.type == "cpu" else False

    @property
    def spent(self) -> bool:
        return self._buffer is None

    def restore(self, device: str | torch.device) -> int:
        """Copy the weights onto `device` in one transfer and rebind every tensor to its slice;
        returns the bytes copied. The host buffer is released right after, off this thread.
        Onto the CPU from an unpinned buffer the tensors are rebound to the buffer itself:
        nothing is copied (returns 0) and the buffer stays, as the weights' memory."""
        if self._buffer is None:
            raise RuntimeError("these parked weights were already restored or discarded")
        target = torch.device(device)
        if target.type == "cpu" and not self.pinned:
            # Host memory is where the weights go: the buffer becomes their block, uncopied.
            block, copied = self._buffer, 0
        else:
            block = torch.empty(self.nbytes, dtype=torch.uint8, device=target)
            # Pinned -> device copies are asynchronous; the synchronize below orders them.
            block.copy_(self._buffer, non_blocking=self.pinned)
            copied = self.nbytes
        for slot in self._slots:
            view = _typed_view(block, slot)
            for tensor in slot.tensors:
                tensor.data = view
        if target.type == "cuda":
            torch.cuda.synchronize(target)
        if copied:
            _free_later(self._buffer)
        self._buffer = None
        return copied

    def discard(self) -> None:
        """Drop the parked copy without restoring it (the module stays empty)."""
        self._buffer = None
        self._slots = []


def park(module: torch.nn.Module, *, pin_memory: bool | None = None) -> ParkedWeights:
    """Move `module`'s parameters and buffers into one host buffer and release the originals.

    `pin_memory` defaults to True when the weights live on a CUDA device. Raises ValueError
    when the module has tensors on the meta device (never loaded) or on several devices.
    """
    slots, total, device = _layout(module)
    if pin_memory is None:
        pin_memory = device.type == "cuda"
    block = _restored_block(slots, total)
    if block is not None and device.type == "cpu" and not pin_memory:
        # CPU weights restored in one block laid out exactly like the buffer: that block is
        # the buffer (the tensors are emptied below, so the buffer holds the only reference).
        return ParkedWeights(_unbind(block, slots, device), slots, device)
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin_memory)
    if block is not None:
        # Restored weights are views of one block laid out exactly like the buffer: one copy.
        buffer.copy_(block, non_blocking=pin_memory)
    else:
        if not pin_memory:
            # Fault the fresh pages in with one wide write first: many small copies faulting
            # pages side by side on several threads run three times slower than one big one.
            buffer.zero_()
        for slot in slots:
            # Device -> pinned host copies are asynchronous; synchronized before releasing.
            _typed_view(buffer, slot).copy_(slot.tensors[0], non_blocking=pin_memory)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return ParkedWeights(_unbind(buffer, slots, device), slots, device)


def _unbind(buffer: torch.Tensor, slots: list[_Slot], device: torch.device) -> torch.Tensor:
    """Empty every parked tensor (its memory is released unless `buffer` is it); returns
    `buffer`."""
    for slot in slots:
        empty = torch.empty(0, dtype=slot.dtype, device=device)
        for tensor in slot.tensors:
            tensor.data = empty
    return buffer


def share(module: torch.nn.Module) -> torch.Tensor:
    """Put `module`'s parameters and buffers (on the CPU) in one block of shared memory and
    return it as uint8: every tensor is a view of it, so another process maps all of them
    with one handle. One copy, none when they already are views of one shared block."""
    slots, total, device = _layout(module)
    if device.type != "cpu":
        raise ValueError(f"only CPU weights can be shared with other processes, not {device}")
    block = _restored_block(slots, total)
    if block is not None and block.is_shared():
        return block
    block = torch.empty(total, dtype=torch.uint8)
    block.share_memory_()
    for slot in slots:
        view = _typed_view(block, slot)
        view.copy_(slot.tensors[0])
        for tensor in slot.tensors:
            tensor.data = view
    return block


def _free_later(buffer: torch.Tensor) -> None:
    """Drop `buffer` on the freeing thread: the work item holds the last reference."""
    _freeing.submit(_keep, buffer)


def _keep(buffer: torch.Tensor) -> None:
    """Nothing: the buffer is freed when the finished work item lets go of it."""


def release(module: torch.nn.Module) -> None:
    """Free every parameter and buffer of `module` now, leaving it empty (unusable).

    Models often hold reference cycles (modules pointing at their parents, hooks), so
    dropping the last reference frees nothing until the garbage collector runs, and a full
    collection in a process that imported torch, transformers and MLflow holds the GIL for
    half a second. Emptying the tensors in place frees their memory at once; the module
    objects left behind are small and go with the next collection.
    """
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def _layout(module: torch.nn.Module) -> tuple[list[_Slot], int, torch.device]:
    groups: dict[tuple[object, ...], list[torch.Tensor]] = {}
    devices: set[torch.device] = set()
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type == "meta":
            raise ValueError("cannot park a module with tensors on the meta device (not loaded)")
        devices.add(tensor.device)
        # Two objects viewing the same data (ties made by sharing storage rather than the
        # Parameter object) are parked once and rebound together.
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
            tensor.device,
        )
        group = groups.setdefault(key, [])
        if not any(t is tensor for t in group):
            group.append(tensor)
    if len(devices) > 1:
        raise ValueError(
            f"cannot park a module spread over several devices: {sorted(map(str, devices))}"
        )
    device = devices.pop() if devices else torch.device("cpu")
    slots: list[_Slot] = []
    offset = 0
    for tensors in groups.values():
        first = tensors[0]
        nbytes = first.numel() * first.element_size()
        slots.append(_Slot(tuple(tensors), offset, nbytes, first.dtype, first.shape))
        offset += -(-nbytes // ALIGNMENT) * ALIGNMENT
    return slots, offset, device


def _restored_block(slots: list[_Slot], total: int) -> torch.Tensor | None:
    """The single block the weights are views of, as uint8, when `ParkedWeights.restore`
    laid them out exactly as `slots` do; None otherwise."""
    if not slots:
        return None
    storage = slots[0].tensors[0].untyped_storage()
    base = storage.data_ptr()
    if storage.nbytes() != total:
        return None
    for slot in slots:
        tensor = slot.tensors[0]
        if (
            tensor.untyped_storage().data_ptr() != base
            or tensor.data_ptr() - base != slot.offset
            or not tensor.is_contiguous()
        ):
            return None
    return torch.empty(0, dtype=torch.uint8, device=slots[0].tensors[0].device).set_(
        storage, 0, (total,), (1,)
    )


def _typed_view(block: torch.Tensor, slot: _Slot) -> torch.Tensor:
    """The slice of a uint8 block holding `slot`, viewed as the slot's dtype and shape."""
    return block[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
