"""Reading and checking a PEFT LoRA adapter folder, torch-free.

Contract: `read_adapter(folder)` parses `adapter_config.json` and the header of
`adapter_model.safetensors` (no tensor is read) into an `AdapterSpec`: per target module its
rank, input and output widths and scaling (`lora_alpha / r`, or `/ sqrt(r)` with
`use_rslora`; `rank_pattern` and `alpha_pattern` apply per module as in PEFT). Whatever
would change the math beyond `W x + B A x * scaling` is refused with `AdapterError` naming
the PEFT field (DoRA, `modules_to_save`, bias, embedding or output-head targets, ...), as are
pickle-only adapters and ranks above a bound. `check_adapter_fits(spec, base_dir)` compares
the shapes with the base's safetensors headers; `adapter_bytes(spec)` is what the adapter
costs on a device. The registry calls these at registration, so nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.errors import InputError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
# Ranks beyond this are refused outright (LoRA ranks in use are 8-128); an engine refuses
# ranks above its own `max_lora_rank` when it loads the adapter.
MAX_RANK = 512
# PEFT saves tensors under the wrapped model's names: `base_model.model.<module>.lora_A.weight`.
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
# Output heads and embeddings: the engine runs the head on selected rows only and embeddings
# are not linear layers, so adapters there are refused by name.
_UNSUPPORTED_TARGETS = frozenset({"lm_head", "embed_tokens", "wte", "embed_out", "embed_in"})
# PEFT options that change the forward pass (or the set of trained weights) beyond plain LoRA
# on linear layers: refused when set to anything but their default.
_UNSUPPORTED_OPTIONS: dict[str, str] = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "layer_replication": "layer replication",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "target_parameters": "LoRA on raw parameters such as MoE experts (target_parameters)",
    "lora_bias": "a trained bias on lora_B (lora_bias)",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2 style Conv1D layers)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing between adapters (arrow_config)",
    "megatron_config": "Megatron parallel layers (megatron_config)",
}
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


class AdapterError(InputError):
    """An adapter that cannot be served on this base; the message names the field or tensor
    at fault and what to do about it."""

    def __init__(self, message: str, *, param: str | None = "source") -> None:
        super().__init__(message, param=param)


@dataclass(frozen=True)
class ModuleLoRA:
    """One adapted linear layer: `y = W x + (B A x) * scaling`, A `(rank, in)`, B `(out, rank)`."""

    module: str  # the base model's module name, e.g. "model.layers.0.self_attn.q_proj"
    a_key: str  # tensor names in adapter_model.safetensors
    b_key: str
    rank: int
    in_features: int
    out_features: int
    scaling: float


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter folder holds, checked: its target modules with shapes and scaling."""

    folder: Path
    rank: int  # the largest rank of any module (`r` unless `rank_pattern` raises one)
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # as configured (a regex string becomes one entry)
    modules: tuple[ModuleLoRA, ...]
    dtype: str  # safetensors dtype of the tensors ("F32", "BF16", ...)
    base_model_name_or_path: str | None = None


def read_adapter(folder: Path, *, max_rank: int = MAX_RANK) -> AdapterSpec:
    """The adapter in `folder`, checked; AdapterError names what cannot be served."""
    folder = Path(folder)
    config = _read_config(folder)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        if (folder / PICKLE_FILE).is_file():
            raise AdapterError(
                f"{folder} holds only {PICKLE_FILE} (a pickle, which can run code when loaded); "
                f"save the adapter with safe_serialization=True to get {WEIGHTS_FILE}"
            )
        raise AdapterError(f"{folder} has no {WEIGHTS_FILE}; is it a PEFT LoRA adapter folder?")
    _refuse_unsupported(config)
    rank, alpha = _positive(config, "r"), _positive(config, "lora_alpha")
    use_rslora = bool(config.get("use_rslora", False))
    rank_pattern: dict[str, int] = dict(config.get("rank_pattern") or {})
    alpha_pattern: dict[str, float] = dict(config.get("alpha_pattern") or {})
    header = read_safetensors_header(weights)
    modules = _modules(header, folder)
    specs = []
    dtypes: set[str] = set()
    for module, (a_key, b_key) in sorted(modules.items()):
        a, b = header[a_key], header[b_key]
        dtypes.update((a["dtype"], b["dtype"]))
        a_shape, b_shape = list(a["shape"]), list(b["shape"])
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
            raise AdapterError(
                f"{module}: lora_A {a_shape} and lora_B {b_shape} are not a (r, in) and "
                "(out, r) pair of matrices"
            )
        module_rank = a_shape[0]
        expected = rank_pattern.get(_pattern_key(rank_pattern, module), rank)
        if module_rank != expected:
            raise AdapterError(
                f"{module}: lora_A has rank {module_rank} but adapter_config.json says "
                f"r={expected}; the config and the weights do not belong together"
            )
        if module_rank > max_rank:
            raise AdapterError(
                f"{module}: rank {module_rank} exceeds the largest supported rank {max_rank}",
                param="r",
            )
        module_alpha = alpha_pattern.get(_pattern_key(alpha_pattern, module), alpha)
        root = math.sqrt(module_rank) if use_rslora else module_rank
        specs.append(
            ModuleLoRA(
                module, a_key, b_key, module_rank, a_shape[1], b_shape[0], module_alpha / root
            )
        )
    unknown = dtypes - set(_SAFETENSORS_BYTES)
    if unknown:
        raise AdapterError(
            f"{WEIGHTS_FILE} holds tensors of dtype {sorted(unknown)}; expected floats"
        )
    targets = config.get("target_modules")
    return AdapterSpec(
        folder=folder,
        rank=max(m.rank for m in specs),
        alpha=float(alpha),
        use_rslora=use_rslora,
        target_modules=(targets,) if isinstance(targets, str) else tuple(targets or ()),
        modules=tuple(specs),
        dtype=max(dtypes, key=lambda d: _SAFETENSORS_BYTES[d]),
        base_model_name_or_path=config.get("base_model_name_or_path"),
    )


def check_adapter_fits(spec: AdapterSpec, base_dir: Path) -> None:
    """Raise AdapterError unless every adapted module is a linear layer of the base in
    `base_dir` with matching widths (read from its safetensors headers)."""
    shapes: dict[str, list[int]] = {}
    files = sorted(Path(base_dir).glob("*.safetensors"))
    if not files:
        raise AdapterError(f"the base model in {base_dir} has no safetensors weights to check")
    for path in files:
        for name, entry in read_safetensors_header(path).items():
            if name != "__metadata__":
                shapes[name] = list(entry["shape"])
    missing = [m.module for m in spec.modules if f"{m.module}.weight" not in shapes]
    if missing:
        raise AdapterError(
            f"the adapter targets {len(missing)} module(s) the base does not have as linear "
            f"layers, e.g. {missing[:3]}; it was trained for another architecture or model"
        )
    for m in spec.modules:
        shape = shapes[f"{m.module}.weight"]
        if shape != [m.out_features, m.in_features]:
            raise AdapterError(
                f"{m.module}: the adapter's lora_B x lora_A is [{m.out_features}, {m.in_features}] "
                f"but the base's weight is {shape}; it was trained for another model size"
            )


def adapter_bytes(spec: AdapterSpec, element_size: int | None = None) -> int:
    """Device bytes of the adapter at `element_size` bytes an element (None: the file's
    dtype): its slot copy plus its share of the step's stacked copy (two copies; the stacked
    one grows when adapters of a larger rank share the step, ranks being padded to it)."""
    size = element_size or _SAFETENSORS_BYTES[spec.dtype]
    elements = sum(m.rank * (m.in_features + m.out_features) for m in spec.modules)
    return 2 * elements * size


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: tensor name -> {dtype, shape, data_offsets}."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 * 2**20:
                raise ValueError(f"a header of {length} bytes is not plausible")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as e:
        raise AdapterError(f"cannot read the safetensors header of {path}: {e}") from e
    if not isinstance(header, dict):
        raise AdapterError(f"{path} does not hold a safetensors header")
    return header


def _read_config(folder: Path) -> Mapping[str, Any]:
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{folder} has no {CONFIG_FILE}; is it a PEFT adapter folder?") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"cannot read {path}: {e}") from e
    if not isinstance(config, dict):
        raise AdapterError(f"{path} must hold a JSON object")
    return config


def _refuse_unsupported(config: Mapping[str, Any]) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"peft_type {peft_type!r} is not supported; only LORA adapters are")
    task = config.get("task_type")
    if task not in (None, "CAUSAL_LM"):
        raise AdapterError(f"task_type {task!r} is not supported; a causal LM adapter is needed")
    bias = config.get("bias", "none")
    if bias != "none":
        raise AdapterError(f"bias={bias!r} (trained biases) is not supported; use bias='none'")
    for key, what in _UNSUPPORTED_OPTIONS.items():
        if config.get(key):
            raise AdapterError(f"{key}: {what} is not supported by the LLM engine")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    heads = sorted(n for n in names if n in _UNSUPPORTED_TARGETS)
    if heads:
        raise AdapterError(
            f"target_modules {heads}: adapters on embeddings or the output head are not "
            "supported; only the decoder layers' linear projections"
        )


def _positive(config: Mapping[str, Any], key: str) -> float:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise AdapterError(f"{CONFIG_FILE}: {key} must be a positive number, got {value!r}")
    return value


def _modules(header: Mapping[str, Any], folder: Path) -> dict[str, tuple[str, str]]:
    """module name -> (lora_A key, lora_B key); AdapterError for any other tensor."""
    parts: dict[str, dict[str, str]] = {}
    for key in header:
        if key == "__metadata__":
            continue
        name = key.removeprefix(_PREFIX)
        match = _KEY.match(name)
        if match is None:
            raise AdapterError(f"{WEIGHTS_FILE} holds {key!r}, not a LoRA matrix: {_what(key)}")
        module = match["module"]
        if module.rsplit(".", 1)[-1] in _UNSUPPORTED_TARGETS:
            raise AdapterError(
                f"{module}: adapters on embeddings or the output head are not supported"
            )
        parts.setdefault(module, {})[match["part"]] = key
    if not parts:
        raise AdapterError(f"{folder / WEIGHTS_FILE} holds no LoRA matrices")
    incomplete = sorted(m for m, p in parts.items() if len(p) != 2)
    if incomplete:
        raise AdapterError(f"{incomplete[:3]}: lora_A or lora_B is missing")
    return {m: (p["A"], p["B"]) for m, p in parts.items()}


def _what(key: str) -> str:
    if "lora_magnitude_vector" in key:
        return "DoRA (use_dora) is not supported"
    if "lora_embedding" in key:
        return "adapters on embeddings are not supported"
    if key.endswith(".bias"):
        return "trained biases are not supported"
    return "only lora_A / lora_B weights of linear layers are supported"


def _pattern_key(patterns: Mapping[str, Any], module: str) -> str:
    """The `rank_pattern` / `alpha_pattern` key that applies to `module` (PEFT's rule: the
    key matches the module name's tail), or the module name itself."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module
