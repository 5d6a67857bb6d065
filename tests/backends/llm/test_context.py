"""The kernel settings reach an LLM backend through its own context, not the generic one."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from backends.base import BackendContext
from backends.llm.context import LLMContext, kernel_settings
from backends.llm.kernel_settings import KernelSettings


def test_an_llm_context_keeps_every_common_field_and_adds_the_kernels() -> None:
    common = BackendContext(
        "m", "3", {"kv_cache_bytes": 1}, allow_pickle=True, device_budget_bytes=7
    )
    kernels = KernelSettings(enabled=False, cache_dir=Path("/k"), compiler="gcc")
    context = LLMContext.of(common, kernels)
    for f in fields(BackendContext):
        assert getattr(context, f.name) == getattr(common, f.name), f.name
    assert kernel_settings(context) == kernels


def test_a_plain_context_means_the_default_kernels() -> None:
    assert kernel_settings(BackendContext("m", "1")) == KernelSettings()
    assert not hasattr(BackendContext("m", "1"), "kernels")
