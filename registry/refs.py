"""Version references as callers write them: a version number or an alias name.

A number is ASCII digits only: `str.isdigit` also accepts "²" or "١٢", which `int()` then
either refuses (a 500 instead of a 404) or reads as another number than the caller typed.
Numbers past `MAX_VERSION_DIGITS` digits name no version a registry can hold.
"""

from __future__ import annotations

MAX_VERSION_DIGITS = 18  # below 2**63, the largest integer SQL stores


def version_number(ref: str) -> int | None:
    """The version number `ref` names, or None when `ref` is not one (an alias name, say)."""
    if ref.isascii() and ref.isdigit() and len(ref) <= MAX_VERSION_DIGITS:
        return int(ref)
    return None
