"""How the engine's native CPU kernels are built: settings passed down from the hub.

Kept apart from `cpu_kernels` (which imports torch) so settings can name them cheaply."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KernelSettings:
    """Whether the native kernels run, and how they are compiled where the install built none
    for this CPU and these sources: passed down from the hub's settings."""

    # False: never build or use them; the engine runs its torch path.
    enabled: bool = True
    # Where libraries compiled at first use (and remembered failures) are kept; None: the
    # user's cache folder, `~/.cache/model-hub/kernels`. The install's own builds live in the
    # package (`backends/llm/_native`) and are used first.
    cache_dir: Path | None = None
    # The C compiler command for a compile at first use, arguments allowed ("ccache gcc").
    compiler: str = "cc"

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir is not None:
            return self.cache_dir
        return Path.home() / ".cache" / "model-hub" / "kernels"
