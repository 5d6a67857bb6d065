"""The serving side's verdict on an adapter at registration, for the registry (which
imports no backend): read the PEFT folder and check it against its base's files, without
torch and without loading anything."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def adapter_problem(
    adapter_dir: Path, base_dir: Path, base_config: Mapping[str, Any]
) -> str | None:
    """Why the engine cannot run the adapter in `adapter_dir` on the base in `base_dir`
    with the base's runtime config `base_config` (unsupported PEFT features, shapes or target
    modules that do not fit, a rank above the base's `max_lora_rank`), or None."""
    from backends.llm.lora import AdapterError, check_adapter_fits, read_adapter
    from backends.runtime_config import LLMConfig

    try:
        spec = read_adapter(adapter_dir)
        check_adapter_fits(spec, base_dir)
    except AdapterError as e:
        return str(e)
    max_rank = LLMConfig.parse(dict(base_config)).max_lora_rank
    if spec.rank > max_rank:
        return (
            f"its rank {spec.rank} is above the base's max_lora_rank {max_rank}; register "
            "a new base version with a larger max_lora_rank in its config, or a smaller adapter"
        )
    return None
