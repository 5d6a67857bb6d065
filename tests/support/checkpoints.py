"""Editing a tiny model's files to make checkpoints that do not match their configs."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file


def drop_tensor(path: Path, name: str) -> None:
    """Rewrite the safetensors file at `path` without tensor `name`."""
    tensors = load_file(path)
    del tensors[name]
    save_file(tensors, path, metadata={"format": "pt"})
