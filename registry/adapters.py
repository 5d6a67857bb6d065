"""LoRA adapter folders as registry versions: what makes a folder an adapter, what its
registration records, and how its `base` reference is read.

An adapter folder is PEFT's layout: `adapter_config.json` beside `adapter_model.safetensors`
(no tokenizer, no config.json: both come from the base). The checks here are the registry's
own (links, pickle, readable JSON, a manifest); whether the adapter's shapes and target
modules fit its base is the serving side's question, asked through an injected check, as
the registry imports no backend.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from registry.bounded_json import JsonTooDeep, loads_bounded
from registry.errors import InvalidSourceError, NotFoundError
from registry.folder_checks import check_links
from registry.refs import version_number
from registry.sources import (
    PICKLE_SUFFIXES,
    InspectedSource,
    dominant_dtype,
    model_files,
    sha256_file,
)
from registry.views import BaseRef, ModelView

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_adapter_folder(folder: Path) -> bool:
    """Whether `folder` holds a PEFT adapter (its `adapter_config.json`)."""
    return (folder / ADAPTER_CONFIG).is_file()


def parse_base(text: str) -> tuple[str, str]:
    """(model name, version or alias) of a `base` reference `name@version-or-alias`."""
    name, sep, ref = text.strip().partition("@")
    if not sep or not name or not ref:
        raise InvalidSourceError(
            f"base {text!r} must name a registered LLM version as name@version or "
            "name@alias (e.g. llama-8b@3 or llama-8b@production)"
        )
    return name, ref


def resolve_base(text: str, get_model: Callable[[str], ModelView]) -> BaseRef:
    """The registered LLM version `text` (`name@version-or-alias`) names, looked up with
    `get_model`; InvalidSourceError (400) when it names none, or names an adapter."""
    name, ref = parse_base(text)
    try:
        model = get_model(name)
    except NotFoundError as e:
        raise InvalidSourceError(f"base {text!r}: {e}") from None
    if model.kind != "llm":
        raise InvalidSourceError(
            f"base {text!r} is a {model.kind}; a LoRA adapter runs on a registered llm"
        )
    number = version_number(ref)
    version = number if number is not None else model.aliases.get(ref)
    if version is None or version not in model.versions:
        known = ", ".join(str(v) for v in sorted(model.versions)) or "none"
        aliases = ", ".join(f"{a}->{v}" for a, v in sorted(model.aliases.items())) or "none"
        raise InvalidSourceError(
            f"base {text!r}: {name!r} has no version or alias {ref!r} "
            f"(versions: {known}; aliases: {aliases})"
        )
    if model.versions[version].base is not None:
        raise InvalidSourceError(
            f"base {text!r} is itself a LoRA adapter (on {model.versions[version].base}); "
            "name the full model it was trained against"
        )
    return BaseRef(name, version)


def inspect_adapter_folder(folder: Path, *, link_root: Path | None = None) -> InspectedSource:
    """Check an adapter folder's files and compute what registering it records (kind llm;
    the base's runtime config applies, so it brings no defaults of its own)."""
    if not folder.is_dir():
        raise InvalidSourceError(f"source {folder} is not a folder")
    check_links(folder, link_root)
    files = model_files(folder)
    if not (folder / ADAPTER_WEIGHTS).is_file():
        pickles = [p.name for p in files if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            raise InvalidSourceError(
                f"adapter {folder} holds only pickle weights ({', '.join(pickles[:5])}); "
                "pickle can run arbitrary code when loaded, so adapters are accepted as "
                f"{ADAPTER_WEIGHTS} only (save with PEFT's save_pretrained, "
                "safe_serialization=True)"
            )
        raise InvalidSourceError(f"adapter {folder} has no {ADAPTER_WEIGHTS}")
    try:
        config = loads_bounded((folder / ADAPTER_CONFIG).read_bytes(), ADAPTER_CONFIG)
    except JsonTooDeep as e:
        raise InvalidSourceError(str(e)) from None
    except (OSError, ValueError) as e:
        raise InvalidSourceError(f"{ADAPTER_CONFIG} is not readable JSON: {e}") from e
    if not isinstance(config, dict):
        raise InvalidSourceError(f"{ADAPTER_CONFIG} must hold a JSON object")
    return InspectedSource(
        folder=folder,
        kind="llm",
        manifest={p.relative_to(folder).as_posix(): sha256_file(p) for p in files},
        total_bytes=sum(p.stat().st_size for p in files),
        dtype=dominant_dtype([folder / ADAPTER_WEIGHTS]),
    )
