"""Registration refuses a checkpoint that does not cover its config.

A config.json that declares more (or other) layers than the safetensors hold builds a model
whose missing weights transformers initialises at random: it loads, and answers with noise.
`check_checkpoint_covers` builds the config's architecture on the meta device (shapes only,
no memory, no weights read), lists the parameters it needs and compares them with the
tensor names in the safetensors headers. A parameter tied to one the checkpoint holds
(`tie_word_embeddings`: the output head shares the input embedding) is covered; buffers are
never required (they are computed when the model is built: rotary tables, position ids).

Only the kinds loaded through a transformers auto class are checked (an LLM, a reranker);
an embedder is a sentence-transformers folder whose modules load their own way. A folder
that needs its own code (`auto_map`) is not built here: building it would run that code.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from safetensors import safe_open

from registry.errors import InvalidSourceError

log = logging.getLogger(__name__)

_AUTO_CLASS = {"llm": "AutoModelForCausalLM", "reranker": "AutoModelForSequenceClassification"}
# How many missing names a refusal quotes.
_QUOTED = 3


def checkpoint_names(weights: Iterable[Path]) -> set[str]:
    """The tensor names in the safetensors headers of `weights` (no tensor is read)."""
    names: set[str] = set()
    for path in weights:
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def check_checkpoint_covers(
    folder: Path, kind: str, config: Mapping[str, Any], weights: list[Path]
) -> None:
    """Refuse (InvalidSourceError) a `folder` whose safetensors `weights` (those at its top
    level) lack parameters the architecture of `config` (its config.json) needs, naming how
    many and a few of them."""
    auto_name = _AUTO_CLASS.get(kind)
    top = [p for p in weights if p.parent == folder]
    if auto_name is None or not top or not config.get("architectures"):
        return
    if "auto_map" in config or "quantization_config" in config:
        return  # its own code, or quantised tensors under other names: not built here
    needed = _needed_parameters(folder, auto_name)
    if needed is None:
        return
    groups, prefix = needed
    held = checkpoint_names(top)
    missing = [names[0] for names in groups if not any(_held(n, held, prefix) for n in names)]
    # A checkpoint name the architecture does not have is one transformers may rename or
    # fuse at load (per-expert MoE tensors into one); a missing weight in the same layer may
    # be made from it, so only the rest count.
    expected = {n for names in groups for n in names}
    renamed = {_layer(n) for n in held if not _held(n, expected, prefix)}
    missing = [n for n in missing if _layer(n) not in renamed]
    if not missing:
        return
    total = len(groups)
    quoted = ", ".join(missing[:_QUOTED]) + (", ..." if len(missing) > _QUOTED else "")
    layers = config.get("num_hidden_layers")
    raise InvalidSourceError(
        f"the checkpoint in source {folder} lacks {len(missing)} of the {total} weights its "
        f"config.json ({config['architectures'][0]}"
        + (f", {layers} layers" if layers is not None else "")
        + f") needs ({quoted}); they would be initialised at random. Save the config that "
        "matches the weights (save_pretrained writes both)"
    )


def _held(name: str, held: set[str], prefix: str) -> bool:
    """Whether the checkpoint holds parameter `name`, under the names loaders accept (with or
    without the base model's prefix)."""
    if name in held:
        return True
    if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1 :] in held:
        return True
    return bool(prefix) and f"{prefix}.{name}" in held


def _layer(name: str) -> str:
    """The layer a parameter belongs to: its name up to the first index (`model.layers.3`),
    or "" for one outside the numbered layers."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def _needed_parameters(folder: Path, auto_name: str) -> tuple[list[list[str]], str] | None:
    """The architecture's parameters as groups of names sharing one tensor (tied weights),
    and its base-model prefix; None when the config cannot be built here (transformers will
    say why at load)."""
    import torch
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
        with torch.device("meta"):
            model = getattr(transformers, auto_name).from_config(config)
    except Exception as e:  # an architecture this transformers lacks, a config it refuses
        log.info("not checking %s's weights against its config: %s", folder, e)
        return None
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    # Tied weights (applied when the model is built, as the config asks) are one tensor.
    groups = list(by_tensor.values())
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or []]
    groups = [g for g in groups if not any(p.search(n) for p in ignored for n in g)]
    return groups, getattr(model, "base_model_prefix", "") or ""
