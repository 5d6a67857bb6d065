"""What registration refuses to trust in a source folder, checked before anything is copied.

- Source text: a NUL byte, or a path longer than the OS can look up, is refused before the
  path is touched (the OS would raise instead of answering).
- Links out: a symlink whose target lies outside the folder (`weights.safetensors ->
  /etc/hostname`) would have the registry copy a file the folder's owner never meant to
  publish; such links, and anything that is not a regular file or folder (a FIFO blocks the
  reader forever), are refused naming the file. Links within the folder are fine, and so are
  a Hugging Face snapshot's links into its own cache (`link_root`); a link that leads back to
  itself (`ln -s l l`) is refused as a loop.
- Remote code: `auto_map` in config.json / tokenizer_config.json, or Python files in the
  folder, mean the model only loads by running the folder's code; refused unless the hub's
  `trust_remote_code` setting allows it.
- Config numbers: config.json (and its `text_config`) must hold the types transformers
  expects, within sane bounds, and the weights these numbers imply must fit the largest
  device budget (`max_model_bytes`). The estimate is arithmetic on the config (a lower bound:
  one byte per parameter, no KV cache), so nothing is allocated to find out.

Every refusal is an `InvalidSourceError` (400) naming the file, the key or the number.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from registry.errors import InvalidSourceError

REMOTE_CODE_CONFIGS = ("config.json", "tokenizer_config.json")
# Linux's PATH_MAX and NAME_MAX: a longer path or file name cannot exist.
MAX_SOURCE_CHARS = 4096
MAX_NAME_BYTES = 255
# Upper bounds no real model comes near (the largest have ~130 layers, hidden 16k, vocab
# 256k, contexts of 10M); past them a number is a mistake or an attack, not a model.
INT_BOUNDS: dict[str, int] = {
    "num_hidden_layers": 1024,
    "hidden_size": 65_536,
    "intermediate_size": 1_048_576,
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "head_dim": 4096,
    "vocab_size": 16_777_216,
    "max_position_embeddings": 16_777_216,
}


def check_source_text(source: str) -> None:
    """Refuse a `source` no path or URI can be: a NUL byte, more than `MAX_SOURCE_CHARS`
    characters, or a path part longer than `MAX_NAME_BYTES` bytes."""
    if "\x00" in source:
        raise InvalidSourceError(
            "source holds a NUL byte; no path or URI does (check how it was built)"
        )
    if len(source) > MAX_SOURCE_CHARS:
        raise InvalidSourceError(
            f"source is {len(source)} characters long; at most {MAX_SOURCE_CHARS} are accepted"
        )
    for part in source.split("/"):
        if len(part.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            raise InvalidSourceError(
                f"source has a path part of more than {MAX_NAME_BYTES} bytes "
                f"({part[:40]}...), longer than any file name can be"
            )


def check_links(folder: Path, link_root: Path | None = None) -> None:
    """Refuse a symlink out of `link_root` (default `folder`) and any special file."""
    root = (link_root or folder).resolve()
    for current, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:
            path = Path(current, name)
            rel = path.relative_to(folder).as_posix()
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                try:
                    target = path.resolve()
                except RuntimeError:  # Python's word for a symlink loop
                    raise InvalidSourceError(
                        f"{rel} in source {folder} is a symlink loop (it leads back to itself); "
                        "remove it"
                    ) from None
                if not target.is_relative_to(root):
                    raise InvalidSourceError(
                        f"{rel} in source {folder} is a link to {target}, outside the folder; "
                        "only files inside the source folder are registered (copy the file in)"
                    )
                if target.exists() and not (target.is_file() or target.is_dir()):
                    raise InvalidSourceError(f"{rel} in source {folder} is not a regular file")
            elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise InvalidSourceError(
                    f"{rel} in source {folder} is not a regular file (a pipe, socket or "
                    "device); remove it"
                )


def check_remote_code(
    folder: Path,
    configs: Mapping[str, Mapping[str, Any]],
    files: list[Path],
    *,
    trust_remote_code: bool,
) -> None:
    """Refuse a folder that needs its own code to load, unless that is allowed."""
    if trust_remote_code:
        return
    reasons = [f"{name} has auto_map" for name, data in configs.items() if "auto_map" in data]
    code = [p.relative_to(folder).as_posix() for p in files if p.suffix == ".py"]
    if code:
        reasons.append(f"it holds Python code ({', '.join(code[:5])})")
    if reasons:
        raise InvalidSourceError(
            f"source {folder} needs remote code to load: {'; '.join(reasons)}. Running a "
            "model folder's code is refused unless the hub's trust_remote_code setting is on; "
            "use a model whose architecture transformers ships"
        )


def check_config_numbers(config: Mapping[str, Any], *, max_model_bytes: int | None) -> None:
    """config.json's types and bounds, then its implied weights against the largest budget."""
    archs = config.get("architectures")
    if archs is not None and not (
        isinstance(archs, list) and all(isinstance(a, str) for a in archs)
    ):
        raise InvalidSourceError(
            f"config.json architectures must be a list of class names, got {_show(archs)}"
        )
    sections: list[tuple[str, Mapping[str, Any]]] = [("", config)]
    if "text_config" in config:
        text = config["text_config"]
        if not isinstance(text, dict):
            raise InvalidSourceError(
                f"config.json text_config must be an object, got {_show(text)}"
            )
        sections.append(("text_config.", text))
    for prefix, section in sections:
        for key, bound in INT_BOUNDS.items():
            value = section.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= bound:
                raise InvalidSourceError(
                    f"config.json {prefix}{key} must be a positive integer of at most {bound}, "
                    f"got {_show(value)}"
                )
    if max_model_bytes is None:
        return
    text_section = sections[-1][1]
    params = _parameter_lower_bound(text_section)
    if params > max_model_bytes:
        raise InvalidSourceError(
            f"config.json describes a model of at least {params:,} parameters "
            f"({params / 2**30:.1f} GiB even at one byte each), more than the largest device "
            f"budget of {max_model_bytes:,} bytes; check num_hidden_layers, hidden_size, "
            "intermediate_size and vocab_size"
        )


def _parameter_lower_bound(config: Mapping[str, Any]) -> int:
    """Parameters a decoder or encoder with these numbers has at least: the embedding table
    plus, per layer, the query/output and key/value projections and two MLP matrices."""
    hidden = config.get("hidden_size") or 0
    layers = config.get("num_hidden_layers") or 0
    vocab = config.get("vocab_size") or 0
    heads = config.get("num_attention_heads") or 1
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or max(hidden // heads, 1)
    intermediate = config.get("intermediate_size") or 0
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    per_layer += 2 * hidden * intermediate
    return int(vocab * hidden + layers * per_layer)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
