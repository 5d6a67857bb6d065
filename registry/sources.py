"""Inspect a model folder before it becomes a version: safe weights, kind, manifest, dtype.

Everything here runs before anything is written to MLflow or SQL, so a refused source leaves
no trace. Only the files are read (JSON configs and safetensors headers), never the weights.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import safe_open

from registry.bounded_json import JsonTooDeep, loads_bounded
from registry.checkpoint_cover import check_checkpoint_covers
from registry.errors import InvalidSourceError
from registry.folder_checks import (
    REMOTE_CODE_CONFIGS,
    check_config_numbers,
    check_links,
    check_remote_code,
)

KINDS = ("llm", "embedder", "reranker")
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".pkl"})
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json", "spiece.model")
# Files that carry no model content and would only make manifests differ between copies.
IGNORED_PARTS = frozenset({".git", ".cache", "__pycache__", ".hub-verified"})

_SAFETENSORS_DTYPE_NAMES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
}


@dataclass(frozen=True)
class InspectedSource:
    """What registering the folder will record."""

    folder: Path
    kind: str
    manifest: dict[str, str]  # relative path -> sha256
    total_bytes: int
    dtype: str
    # Defaults read from the folder (context length, normalisation, ...), before overrides.
    runtime_defaults: dict[str, Any] = field(default_factory=dict)


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def model_files(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not IGNORED_PARTS.intersection(p.relative_to(folder).parts)
    )


def _read_json(path: Path) -> Any:
    """The JSON in `path`, read with the hub's depth bound (`MAX_JSON_DEPTH`)."""
    try:
        return loads_bounded(path.read_bytes(), path.name)
    except JsonTooDeep as e:
        raise InvalidSourceError(str(e)) from None
    except (OSError, ValueError) as e:
        raise InvalidSourceError(f"{path.name} is not readable JSON: {e}") from e


def _read_json_object(path: Path) -> dict[str, Any]:
    data = _read_json(path)
    if not isinstance(data, dict):
        raise InvalidSourceError(f"{path.name} must hold a JSON object")
    return data


def dominant_dtype(weights: list[Path]) -> str:
    bytes_by_dtype: Counter[str] = Counter()
    for path in weights:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    sl = f.get_slice(name)
                    numel = 1
                    for d in sl.get_shape():
                        numel *= d
                    bytes_by_dtype[sl.get_dtype()] += numel
        except Exception as e:
            raise InvalidSourceError(f"{path.name} is not a valid safetensors file: {e}") from e
    if not bytes_by_dtype:
        return "unknown"
    top = bytes_by_dtype.most_common(1)[0][0]
    return _SAFETENSORS_DTYPE_NAMES.get(top, top.lower())


def detect_kind(folder: Path) -> tuple[str | None, str]:
    """(kind the folder looks like, or None if it cannot tell; the evidence, for messages)."""
    if (folder / "modules.json").is_file():
        return "embedder", "modules.json (a sentence-transformers model)"
    config_path = folder / "config.json"
    if not config_path.is_file():
        return None, "no config.json"
    archs = _read_json_object(config_path).get("architectures") or []
    evidence = f"config.json architectures {archs}"
    if any(a.endswith("ForCausalLM") for a in archs):
        return "llm", evidence
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return "reranker", evidence
    if archs:
        return "embedder", evidence
    return None, evidence


def _runtime_defaults(folder: Path, kind: str) -> dict[str, Any]:
    config = _read_json_object(folder / "config.json") if (folder / "config.json").is_file() else {}
    if kind == "llm":
        text = config.get("text_config", config)
        ctx = text.get("max_position_embeddings")
        return {"context_length": int(ctx)} if ctx else {}
    if kind == "embedder":
        defaults: dict[str, Any] = {}
        modules_path = folder / "modules.json"
        if modules_path.is_file():
            modules = _read_json(modules_path)
            defaults["normalize"] = any("Normalize" in m.get("type", "") for m in modules)
        st_config = folder / "sentence_bert_config.json"
        if st_config.is_file():
            seq = _read_json_object(st_config).get("max_seq_length")
            if seq:
                defaults["max_seq_length"] = int(seq)
        return defaults
    return {}


def inspect_folder(
    folder: Path,
    kind: str,
    *,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    link_root: Path | None = None,
    max_model_bytes: int | None = None,
) -> InspectedSource:
    """Check that `folder` can be served as `kind` and compute what registering it records.
    `link_root`: symlinks may point anywhere under it (default: the folder itself);
    `max_model_bytes`: the largest device budget, which the config's numbers must fit."""
    if kind not in KINDS:
        raise InvalidSourceError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    try:
        exists, is_dir = folder.exists(), folder.is_dir()
    except OSError as e:  # a name too long, say: the OS cannot look the path up
        raise InvalidSourceError(f"source {folder} cannot be looked up: {e.strerror}") from None
    if not exists:
        raise InvalidSourceError(f"source {folder} does not exist")
    if not is_dir:
        raise InvalidSourceError(f"source {folder} is not a folder")
    check_links(folder, link_root)
    files = model_files(folder)
    configs = {
        n: _read_json_object(folder / n) for n in REMOTE_CODE_CONFIGS if (folder / n).is_file()
    }
    if "config.json" in configs:
        check_config_numbers(configs["config.json"], max_model_bytes=max_model_bytes)
    check_remote_code(folder, configs, files, trust_remote_code=trust_remote_code)
    weights = [p for p in files if p.suffix == ".safetensors"]
    pickles = [p for p in files if p.suffix in PICKLE_SUFFIXES]
    if not weights:
        if pickles and not allow_pickle:
            names = ", ".join(p.name for p in pickles[:5])
            raise InvalidSourceError(
                f"source {folder} holds only pickle weights ({names}); pickle can run "
                "arbitrary code when loaded, so only safetensors weights are accepted "
                "(convert with safetensors, or set allow_pickle to override)"
            )
        if not pickles:
            raise InvalidSourceError(f"source {folder} holds no weights (no *.safetensors file)")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise InvalidSourceError(
            f"source {folder} has no tokenizer (expected one of {', '.join(TOKENIZER_FILES)})"
        )
    detected, evidence = detect_kind(folder)
    if detected is None and kind != "embedder":
        raise InvalidSourceError(f"source {folder} is not a {kind}: {evidence}")
    if detected is not None and detected != kind:
        raise InvalidSourceError(
            f"source {folder} looks like a {detected}, not a {kind} ({evidence})"
        )
    dtype = dominant_dtype(weights) if weights else "unknown"  # reads (checks) every header
    manifest = {p.relative_to(folder).as_posix(): sha256_file(p) for p in files}
    return InspectedSource(
        folder=folder,
        kind=kind,
        manifest=manifest,
        total_bytes=sum(p.stat().st_size for p in files),
        dtype=dtype,
        runtime_defaults=_checked_runtime_defaults(folder, kind),
    )


def check_weights_cover_config(folder: Path, kind: str) -> None:
    """Refuse an inspected `folder` whose safetensors lack weights its config.json's
    architecture needs (see `registry.checkpoint_cover`); run once the architecture is known
    to be servable, so an unsupported one is refused as such first."""
    if not (folder / "config.json").is_file():
        return
    weights = [p for p in model_files(folder) if p.suffix == ".safetensors"]
    check_checkpoint_covers(folder, kind, _read_json_object(folder / "config.json"), weights)


def _checked_runtime_defaults(folder: Path, kind: str) -> dict[str, Any]:
    try:
        return _runtime_defaults(folder, kind)
    except (TypeError, ValueError, AttributeError) as e:  # a config of the wrong shape
        raise InvalidSourceError(f"source {folder} has a malformed config: {e}") from e
