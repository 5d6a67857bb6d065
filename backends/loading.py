"""Safe, measurable loading helpers shared by every backend.

Weights are read from safetensors only; a folder holding only pickle checkpoints (`*.bin`,
`*.pt`, `*.pth`, `*.ckpt`) is refused unless the deployment explicitly allows pickle.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from backends.errors import LoadError

PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".pkl"})

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

# Bytes per element of the safetensors dtype names found in file headers.
SAFETENSORS_DTYPE_BYTES: dict[str, int] = {
    "F64": 8, "I64": 8, "U64": 8,
    "F32": 4, "I32": 4, "U32": 4,
    "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip


def parse_dtype(name: str | None) -> torch.dtype | None:
    """`"bfloat16"` -> torch.bfloat16; None or "auto" -> None (keep the checkpoint's dtype)."""
    if name is None or name == "auto":
        return None
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        known = sorted(set(_DTYPES))
        raise LoadError(f"unknown dtype {name!r}; use one of {known} or 'auto'") from None


def safetensors_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.safetensors") if p.is_file())


def require_safe_weights(folder: Path, *, allow_pickle: bool = False) -> list[Path]:
    """The folder's safetensors files; raise LoadError when only pickle weights are present."""
    weights = safetensors_files(folder)
    if weights:
        return weights
    pickles = sorted(p.name for p in folder.rglob("*") if p.suffix in PICKLE_SUFFIXES)
    if pickles and not allow_pickle:
        raise LoadError(
            f"{folder} holds only pickle checkpoints ({', '.join(pickles[:5])}); pickle can run "
            "arbitrary code on load, so only safetensors weights are accepted "
            "(set allow_pickle to override)"
        )
    if not pickles:
        raise LoadError(f"{folder} holds no weights (no *.safetensors file)")
    return []


def tensor_bytes_from_headers(files: Iterable[Path], dtype: torch.dtype | None = None) -> int:
    """Bytes the tensors of these safetensors files take once loaded, read from the headers
    only; with `dtype`, floating-point tensors are counted as cast to it."""
    total = 0
    target = torch.empty((), dtype=dtype).element_size() if dtype is not None else None
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                sl = f.get_slice(name)
                numel = 1
                for dim in sl.get_shape():
                    numel *= dim
                kind = sl.get_dtype()
                size = SAFETENSORS_DTYPE_BYTES.get(kind, 4)
                if target is not None and kind.startswith(("F", "BF")):
                    size = target
                total += numel * size
    return total


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage counted once (tied weights)."""
    seen: set[int] = set()
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in seen or tensor.device.type == "meta":
            continue
        seen.add(key)
        total += storage.nbytes()
    return total
