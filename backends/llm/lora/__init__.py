"""LoRA adapters on the LLM engine's base model (PEFT format), many per step.

- `adapter`: read and check an adapter folder against a base, torch-free (the registry's
  check at registration): `read_adapter`, `check_adapter_fits`, `adapter_bytes`.
- `slots`: which adapter holds which device slot (least recently used out), pure Python.
- `layers`: `LoRALinear`, the per-token batched LoRA matmul around a target linear layer.
- `manager`: one base's adapters: host copies, slots, in-flight counts, each step's batch.

Only `adapter` is imported here, so the package stays importable without torch.
"""

from backends.llm.lora.adapter import (
    AdapterError,
    AdapterSpec,
    ModuleLoRA,
    adapter_bytes,
    check_adapter_fits,
    read_adapter,
)

__all__ = [
    "AdapterError",
    "AdapterSpec",
    "ModuleLoRA",
    "adapter_bytes",
    "check_adapter_fits",
    "read_adapter",
]
