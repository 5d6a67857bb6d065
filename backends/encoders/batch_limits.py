"""How a model's batches are formed: the limits the dynamic batcher works under, taken from a
version's checked runtime config (`backends.runtime_config.EncoderConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from backends.runtime_config import EncoderConfig

_CONFIG = EncoderConfig()  # the runtime config's defaults are the batcher's


@dataclass(frozen=True)
class BatchLimits:
    """How a model's batches are formed; from a version's runtime config."""

    # Padded tokens per batch (batch size times its longest input; real tokens when unpadded).
    max_batch_tokens: int = _CONFIG.max_batch_tokens
    # Inputs per batch.
    max_batch_size: int = _CONFIG.max_batch_size
    # How long an idle model waits for a batch to fill, after the oldest input arrived.
    batch_wait_s: float = _CONFIG.batch_wait_ms / 1000
    # Inputs allowed to wait for a forward pass; more get CapacityError (HTTP 503).
    max_queue: int = _CONFIG.max_queue
    # Longest estimated wait for a forward pass a request is admitted with; None: no bound.
    max_queue_time_s: float | None = None
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
    # Batches taken while an input waits for it to gain one priority level (aging: a batch-
    # class input outranks newer interactive ones after waiting 2x this). Not a config key.
    priority_aging_batches: int = 16

    @classmethod
    def from_config(cls, config: EncoderConfig) -> BatchLimits:
        """Limits from a checked runtime config; keys it leaves to the device
        (`forward_workers`, `batch_overhead_tokens`) keep these defaults."""
        default = cls()
        return cls(
            max_batch_tokens=config.max_batch_tokens,
            max_batch_size=config.max_batch_size,
            batch_wait_s=config.batch_wait_ms / 1000,
            max_queue=config.max_queue,
            max_queue_time_s=(
                None if config.max_queue_time_ms is None else config.max_queue_time_ms / 1000
            ),
            forward_workers=config.forward_workers or default.forward_workers,
            batch_overhead_tokens=(
                default.batch_overhead_tokens
                if config.batch_overhead_tokens is None
                else config.batch_overhead_tokens
            ),
        )
