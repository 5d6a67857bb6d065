"""The serving side's verdict on an adapter at registration, for the registry (which
imports no backend): read the PEFT folder and check it against its base's files, without
torch and without loading anything."""

from __future__ import annotations

from pathlib import Path


def adapter_problem(adapter_dir: Path, base_dir: Path) -> str | None:
    """Why the engine cannot run the adapter in `adapter_dir` on the base in `base_dir`
    (unsupported PEFT features, shapes or target modules that do not fit), or None."""
    from backends.llm.lora import AdapterError, check_adapter_fits, read_adapter

    try:
        check_adapter_fits(read_adapter(adapter_dir), base_dir)
    except AdapterError as e:
        return str(e)
    return None
