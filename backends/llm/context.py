"""What an LLM backend is told when it is created: the context every kind gets, plus the
settings of the engine's native CPU kernels, which only the LLM engine builds."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from backends.base import BackendContext
from backends.llm.kernel_settings import KernelSettings
from backends.llm.structured.pool import CompilePool


@dataclass(frozen=True)
class LLMContext(BackendContext):
    """A `BackendContext` for an `LLMBackend`; a plain `BackendContext` means default kernels."""

    # The engine's native CPU kernels: on or off, their cache and compiler (hub settings
    # `engine:`).
    kernels: KernelSettings = field(default_factory=KernelSettings)
    # Where grammars compile: the hub's one pool, shared by its LLMs (hub settings
    # `structured_outputs:`); None: the backend makes a pool of its own at load.
    grammar_pool: CompilePool | None = None
    # The verified local folder of the `speculative.draft` version, where one is configured.
    draft_dir: Path | None = None

    @classmethod
    def of(
        cls,
        context: BackendContext,
        kernels: KernelSettings,
        grammar_pool: CompilePool | None = None,
        draft_dir: Path | None = None,
    ) -> LLMContext:
        """`context` with these kernel settings, grammar pool and draft folder."""
        common = {f.name: getattr(context, f.name) for f in fields(BackendContext)}
        return cls(**common, kernels=kernels, grammar_pool=grammar_pool, draft_dir=draft_dir)


def kernel_settings(context: BackendContext) -> KernelSettings:
    """The kernel settings `context` carries; the defaults for a plain `BackendContext`."""
    return context.kernels if isinstance(context, LLMContext) else KernelSettings()


def grammar_pool(context: BackendContext) -> CompilePool | None:
    """The grammar pool `context` carries, None for none."""
    return context.grammar_pool if isinstance(context, LLMContext) else None


def draft_dir(context: BackendContext) -> Path | None:
    """The draft model's folder `context` carries, None for none."""
    return context.draft_dir if isinstance(context, LLMContext) else None
