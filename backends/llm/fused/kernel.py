"""`csrc/fused_decode.c` through ctypes: the structs it reads, and the loaded library.

The structs mirror the C ones field for field (`hub_layer`, `hub_model`, `hub_step`); a
pointer field holds a tensor's data pointer, which the caller keeps alive. The step checks
every index it follows against the sizes the structs give (the table's length, the rotary
tables' rows, the scratch's floats) and refuses the step without running it: `FusedKernel
.step` raises ValueError naming what is out of range.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any

import torch

from backends.llm.cpu_kernels import (
    load_native,
    raise_for_status,
    switched_off,
    torch_uses_gnu_openmp,
)
from backends.llm.kernel_settings import KernelSettings

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parents[1] / "csrc" / "fused_decode.c"

_p = ctypes.POINTER(ctypes.c_float)
_i64 = ctypes.c_int64
_i64p = ctypes.POINTER(ctypes.c_int64)
_i8p = ctypes.POINTER(ctypes.c_int8)


class CWeight(ctypes.Structure):
    """A linear layer: float32 weights, or int8 ones with a float32 scale per row; a bias."""

    _fields_ = [("f32", _p), ("i8", _i8p), ("scale", _p), ("bias", _p)]


class CLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _p),
        ("post_norm", _p),
        *((name, CWeight) for name in ("q", "k", "v", "o")),
        ("q_norm", _p),
        ("k_norm", _p),
        *((name, CWeight) for name in ("gate", "up", "down")),
        ("cache", _p),
        ("window", _i64),
        ("scaling", ctypes.c_float),
    ]


class CModel(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter")),
        *((name, _i64) for name in ("vocab", "layers", "num_blocks", "block_size")),
        ("max_context", _i64),
        ("threads", _i64),
        ("eps", ctypes.c_float),
        ("qk_eps", ctypes.c_float),
        ("embed", _p),
        ("final_norm", _p),
        ("lm_head", CWeight),
        ("layer", ctypes.POINTER(CLayer)),
        ("stream_weights", _i64),
    ]


class CStep(ctypes.Structure):
    """A step's rows. Its pointers are plain addresses (`c_void_p`, the same layout as the C
    struct's typed pointers): set from integers, they cost no ctypes cast per step."""

    _fields_ = [
        ("rows", _i64),
        *((name, ctypes.c_void_p) for name in ("tokens", "slots", "tables", "table_starts")),
        *((name, ctypes.c_void_p) for name in ("lens", "cos", "sin", "rope_rows")),
        ("samples", _i64),
        *((name, ctypes.c_void_p) for name in ("sample_rows", "logits", "work")),
        # The lengths of `tables`, of `cos` and `sin` (rows), and of `work` (floats).
        *((name, _i64) for name in ("table_len", "rope_len", "work_floats")),
    ]


class FusedKernel:
    """`csrc/fused_decode.c` loaded: the step, and the scratch it needs."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._step = library.hub_fused_step
        self._step.argtypes = [ctypes.POINTER(CModel), ctypes.POINTER(CStep)]
        self._step.restype = ctypes.c_int  # ctypes releases the GIL for the call
        self._work = library.hub_fused_work_floats
        self._work.argtypes = [ctypes.POINTER(CModel), _i64]
        self._work.restype = _i64
        self.threaded = bool(library.hub_fused_threaded())

    def work_floats(self, model: CModel, rows: int) -> int:
        return int(self._work(ctypes.byref(model), rows))

    def step(self, model: CModel, step: CStep) -> None:
        """Run `step`; ValueError (nothing run) for an index or size out of range."""
        raise_for_status("fused step", self._step(ctypes.byref(model), ctypes.byref(step)))


@functools.cache
def fused_kernel(settings: KernelSettings = KernelSettings()) -> FusedKernel | None:
    """The kernel (the install's build, or compiled on first use); None where no library
    loads (a WARNING, once per settings: the slow path) or `settings` switch it off."""
    if not settings.enabled:
        switched_off(SOURCE.stem)
        return None
    try:
        return load_native(SOURCE, FusedKernel, openmp=torch_uses_gnu_openmp(), settings=settings)
    except (RuntimeError, ValueError) as e:
        log.warning("slow path: CPU steps run through transformers, no fused kernel loads: %s", e)
        return None


def fptr(t: torch.Tensor) -> Any:
    """A float32 tensor's data as the structs' float pointer."""
    return ctypes.cast(t.data_ptr(), _p)


def bptr(t: torch.Tensor) -> Any:
    """An int8 tensor's data as the structs' int8 pointer."""
    return ctypes.cast(t.data_ptr(), _i8p)
