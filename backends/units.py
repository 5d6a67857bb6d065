"""Byte sizes and durations as people write them in config files: the one parser of each.

They live in `backends/` so backends (the runtime config models) and the hub (settings,
requests) read sizes alike; `hub.units` re-exports them.
"""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
    "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30,
    "ti": 2**40, "tib": 2**40,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DURATION_RE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def parse_bytes(value: str | int | float) -> int:
    """`"4GiB"` -> 4294967296, `"512MB"` -> 512000000, `1024` -> 1024."""
    if isinstance(value, bool):
        raise ValueError("a byte size must be a number or a string like '4GiB'")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"a byte size must be a finite number >= 0, not {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a byte size (examples: 4GiB, 512MB, 1073741824)")
    match = _SIZE_RE.match(value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{value!r} is not a byte size (examples: 4GiB, 512MB, 1073741824)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_duration(value: str | int | float) -> float:
    """Seconds from `"5m"`, `"30s"`, `"250ms"`, `"-1"`, or a plain number of seconds."""
    # Anything else (null, {}, [], true) and non-finite numbers (NaN, 1e999, 10**400) are
    # refused with ValueError, which request validation turns into the caller's 4xx.
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError("a duration must be a number or a string like '5m'")
    if isinstance(value, int | float):
        seconds = float(value) if abs(value) < 1e300 else math.inf
    else:
        match = _DURATION_RE.match(value)
        if not match:
            raise ValueError(f"{value[:40]!r} is not a duration (examples: 30s, 5m, 1h, -1)")
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if not math.isfinite(seconds):
        raise ValueError(f"a duration must be finite (or -1 for forever), got {value!r:.40}")
    return seconds


# The longest keep-alive taken as a duration: a year. Longer is no different from forever,
# which is said with -1; a bigger number is a mistake (or a probe), refused as such.
MAX_KEEP_ALIVE_S = 365 * 86400.0


def parse_keep_alive(value: str | int | float) -> float:
    """Ollama's keep_alive in seconds: a duration (`"5m"`, `30`) up to `MAX_KEEP_ALIVE_S`, 0
    to unload after the request, or -1 (`"-1"`, `"-1s"`) to keep the model forever. Any other
    negative value, and anything longer, is refused with ValueError naming the range."""
    seconds = parse_duration(value)
    if seconds == -1:
        return -1.0
    if seconds < 0:
        raise ValueError(
            f"keep_alive {value!r:.40} is negative; only -1 (keep forever) is, or a duration >= 0"
        )
    if seconds > MAX_KEEP_ALIVE_S:
        raise ValueError(
            f"keep_alive {value!r:.40} is longer than {MAX_KEEP_ALIVE_S / 86400:.0f} days, the "
            "most taken; use -1 to keep the model loaded forever"
        )
    return seconds


def format_bytes(n: int | float) -> str:
    """`1536` -> `"1.5 KiB"`: binary units, one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
