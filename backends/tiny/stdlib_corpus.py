"""Training text every machine has: the Python standard library's own source files.

Contract: `stdlib_corpus(train_chars, held_out_chars)` reads `.py` files under
`sysconfig.get_paths()["stdlib"]` (tests, site-packages, generated tables and data modules
left out) and returns two disjoint lists of file texts, training and held-out, of about the
sizes asked. Which file goes where depends on its path relative to the stdlib folder alone
(a CRC of it), and the order is fixed, so one Python version gives the same corpus on every
machine; another version's stdlib differs, which is why callers key caches on the version.
"""

from __future__ import annotations

import sys
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

# Folders that are not ordinary library code: tests (huge, odd on purpose), installed
# packages, codec tables and help-text data modules (long literals, not code).
_SKIPPED_PARTS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "__pycache__",
        "encodings",
        "pydoc_data",
        "ensurepip",
    }
)
_SKIPPED_PREFIX = "config-"  # the build's Makefile folder
# Files longer than this are mostly generated tables; shorter ones are enough text.
_MAX_FILE_CHARS = 200_000
# One file in this many (by the CRC of its path) is held out.
_HELD_OUT_ONE_IN = 10


@dataclass(frozen=True)
class Corpus:
    """Source files for training and a disjoint held-out set, each file's text whole."""

    train: list[str]
    held_out: list[str]
    python_version: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _source_files(root: Path) -> list[Path]:
    files = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        if any(p in _SKIPPED_PARTS or p.startswith(_SKIPPED_PREFIX) for p in parts[:-1]):
            continue
        files.append(path)
    # A fixed pseudo-random order (by path CRC) so a prefix of the list mixes many packages.
    return sorted(files, key=lambda p: (_crc(p, root), p.relative_to(root).as_posix()))


def _crc(path: Path, root: Path) -> int:
    return zlib.crc32(path.relative_to(root).as_posix().encode())


def stdlib_corpus(train_chars: int, held_out_chars: int) -> Corpus:
    """Whole stdlib files until each part holds at least the characters asked (or the files
    run out); held-out files are never in the training part."""
    root = stdlib_root()
    train: list[str] = []
    held_out: list[str] = []
    sizes = {"train": 0, "held_out": 0}
    for path in _source_files(root):
        part, budget = (
            ("held_out", held_out_chars)
            if _crc(path, root) % _HELD_OUT_ONE_IN == 0
            else ("train", train_chars)
        )
        if sizes[part] >= budget:
            if sizes["train"] >= train_chars and sizes["held_out"] >= held_out_chars:
                break
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip() or len(text) > _MAX_FILE_CHARS:
            continue
        (held_out if part == "held_out" else train).append(text)
        sizes[part] += len(text)
    if not train or not held_out:
        raise FileNotFoundError(
            f"found no Python source under {root}: the trained pair needs the standard "
            "library's .py files (some distributions ship only bytecode; install the "
            "python3 source package)"
        )
    return Corpus(train, held_out, f"{sys.version_info.major}.{sys.version_info.minor}")
