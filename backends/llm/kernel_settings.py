"""How the engine's native CPU kernels are built: settings passed down from the hub.

Kept apart from `cpu_kernels` (which imports torch) so settings can name them cheaply."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KernelSettings:
    """Whether and how the native kernels are built: passed down from the hub's settings."""

    # False: never build or use them; decode attention runs in torch.
    enabled: bool = True
    # Where built libraries (and remembered failures) are kept; None: the user's cache
    # folder, `~/.cache/model-hub/kernels`.
    cache_dir: Path | None = None
    # The C compiler command, arguments allowed ("ccache gcc").
    compiler: str = "cc"

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir is not None:
            return self.cache_dir
        return Path.home() / ".cache" / "model-hub" / "kernels"
