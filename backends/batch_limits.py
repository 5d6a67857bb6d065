"""How a model's batches are formed: the limits the dynamic batcher works under, read from a
version's runtime config (registered with the version, `config` at registration)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BatchLimits:
    """How a model's batches are formed; read from a version's runtime config."""

    # Padded tokens per batch (batch size times its longest input; real tokens when unpadded).
    max_batch_tokens: int = 16384
    # Inputs per batch.
    max_batch_size: int = 32
    # How long an idle model waits for a batch to fill, after the oldest input arrived.
    batch_wait_s: float = 0.002
    # Inputs allowed to wait for a forward pass; more get CapacityError (HTTP 503).
    max_queue: int = 4096
    # Seconds suggested to callers refused for capacity.
    retry_after_s: float = 1.0
    # Forward threads taking batches from the pool, each running its own batch.
    forward_workers: int = 1
    # The fixed cost of one forward pass, in padded tokens: what a batch must save in padding
    # to be worth splitting. Small on a CPU (a pass costs about its tokens), large on a GPU
    # (a pass costs about the same whatever its size).
    batch_overhead_tokens: int = 32
    # Whether the model runs batches unpadded (packed into one row): then a batch costs its
    # real tokens, and `max_batch_tokens` counts those. Set by the backend, not the config.
    unpadded: bool = False

    @classmethod
    def from_runtime_config(cls, config: Mapping[str, Any]) -> BatchLimits:
        """Limits from the runtime-config keys `max_batch_tokens`, `max_batch_size`,
        `batch_wait_ms`, `max_queue`, `forward_workers` and `batch_overhead_tokens`; absent
        keys keep their defaults. Raises ValueError naming the key when a value is unusable."""
        default = cls()
        values: dict[str, Any] = {}
        minimums = {"max_batch_tokens": 1, "max_batch_size": 1, "max_queue": 1,
                    "forward_workers": 1, "batch_overhead_tokens": 0}  # fmt: skip
        for key, minimum in minimums.items():
            value = config.get(key, getattr(default, key))
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(
                    f"runtime config {key}={value!r}: expected an integer >= {minimum}"
                )
            values[key] = value
        wait_ms = config.get("batch_wait_ms", default.batch_wait_s * 1000)
        if isinstance(wait_ms, bool) or not isinstance(wait_ms, int | float) or wait_ms < 0:
            raise ValueError(f"runtime config batch_wait_ms={wait_ms!r}: expected a number >= 0")
        return cls(**values, batch_wait_s=float(wait_ms) / 1000)
