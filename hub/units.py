"""Byte sizes and durations as people write them in config files.

The parsers live in `backends.units` (backends read runtime configs with them and may not
import the hub); this module is the hub's name for them.
"""

from __future__ import annotations

from backends.units import format_bytes, parse_bytes, parse_duration, parse_keep_alive

__all__ = ["format_bytes", "parse_bytes", "parse_duration", "parse_keep_alive"]
