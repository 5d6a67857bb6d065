"""Engine settings, read once from a model version's runtime config and frozen.

Every key is optional; `EngineConfig.from_runtime_config` validates the ones it knows and
raises `LoadError` naming the key for a bad value. Keys it does not know (such as `dtype`,
read by the loader) are left to their owners.

| key | default | meaning |
| --- | --- | --- |
| `kv_cache_bytes` | 256MiB | KV-cache reservation, bytes or a size string ("64MiB") |
| `kv_cache_fraction` | - | reservation as a fraction of the device budget instead |
| `block_size` | 16 | tokens per KV-cache block |
| `max_num_seqs` | 64 | sequences in one step at most |
| `max_num_batched_tokens` | 512 | tokens (prefill chunks plus decodes) in one step at most |
| `max_model_len` | model's | prompt plus generated tokens of one sequence at most |
| `enable_prefix_caching` | true | reuse KV blocks of identical prompt prefixes |
| `max_n` | 8 | largest `n` (samples per request) accepted |
| `max_tokens_limit` | max_model_len | largest `max_tokens` accepted |
| `default_max_tokens` | 256 | `max_tokens` of a request that sets none (capped by the context) |
| `max_logprobs` | 20 | largest `logprobs` / `top_logprobs` accepted |
| `max_waiting` | 1024 | requests queued before new ones are refused with "retry later" |
| `priority_aging_steps` | 256 | a waiting request gains one priority level per this many steps |
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backends.errors import LoadError

DEFAULT_KV_CACHE_BYTES = 256 * 2**20

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(key: str, value: Any) -> int:
    """Bytes from an int or a string like "64MiB"; LoadError naming `key` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    raise LoadError(f"runtime config {key}={value!r} is not a byte size (e.g. 268435456, '256MiB')")


def _positive_int(config: Mapping[str, Any], key: str, default: int) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LoadError(f"runtime config {key}={value!r} must be a positive integer")
    return value


def kv_cache_reservation(runtime_config: Mapping[str, Any], device_budget_bytes: int | None) -> int:
    """Bytes reserved for the KV cache: `kv_cache_bytes`, else `kv_cache_fraction` of the
    device budget, else the default. Both keys at once is a configuration mistake."""
    has_bytes = runtime_config.get("kv_cache_bytes") is not None
    fraction = runtime_config.get("kv_cache_fraction")
    if has_bytes and fraction is not None:
        raise LoadError("set either kv_cache_bytes or kv_cache_fraction in the runtime config")
    if has_bytes:
        return parse_size("kv_cache_bytes", runtime_config["kv_cache_bytes"])
    if fraction is None:
        return DEFAULT_KV_CACHE_BYTES
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction < 1:
        raise LoadError(f"runtime config kv_cache_fraction={fraction!r} must be in (0, 1)")
    if device_budget_bytes is None:
        raise LoadError(
            "kv_cache_fraction needs the device budget to size the KV cache, and none was "
            "given; set kv_cache_bytes instead or place the model on a budgeted device"
        )
    return int(device_budget_bytes * fraction)


@dataclass(frozen=True)
class EngineConfig:
    """How one engine batches, caches and limits requests; see the module table."""

    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # None: the model's own context length; the runner caps it further by the cache size.
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    max_n: int = 8
    max_tokens_limit: int | None = None
    default_max_tokens: int = 256
    max_logprobs: int = 20
    max_waiting: int = 1024
    priority_aging_steps: int = 256

    @classmethod
    def from_runtime_config(
        cls, runtime_config: Mapping[str, Any], device_budget_bytes: int | None = None
    ) -> EngineConfig:
        c = runtime_config
        max_model_len = c.get("max_model_len")
        if max_model_len is not None:
            max_model_len = _positive_int(c, "max_model_len", 1)
        limit = c.get("max_tokens_limit")
        if limit is not None:
            limit = _positive_int(c, "max_tokens_limit", 1)
        max_num_seqs = _positive_int(c, "max_num_seqs", cls.max_num_seqs)
        budget = _positive_int(c, "max_num_batched_tokens", cls.max_num_batched_tokens)
        if budget < max_num_seqs:
            raise LoadError(
                f"runtime config max_num_batched_tokens={budget} is below max_num_seqs="
                f"{max_num_seqs}: every running sequence needs a token per step"
            )
        prefix = c.get("enable_prefix_caching", True)
        if not isinstance(prefix, bool):
            raise LoadError(f"runtime config enable_prefix_caching={prefix!r} must be true/false")
        return cls(
            kv_cache_bytes=kv_cache_reservation(c, device_budget_bytes),
            block_size=_positive_int(c, "block_size", cls.block_size),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_prefix_caching=prefix,
            max_n=_positive_int(c, "max_n", cls.max_n),
            max_tokens_limit=limit,
            default_max_tokens=_positive_int(c, "default_max_tokens", cls.default_max_tokens),
            max_logprobs=_positive_int(c, "max_logprobs", cls.max_logprobs),
            max_waiting=_positive_int(c, "max_waiting", cls.max_waiting),
            priority_aging_steps=_positive_int(c, "priority_aging_steps", cls.priority_aging_steps),
        )
