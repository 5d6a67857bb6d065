"""Which `config.json` the engine accepts, decided before anything loads: every architecture
the tiny builders make, and nothing else (with a message naming what is supported)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.errors import InputError
from backends.llm.architectures import SUPPORTED_ARCHITECTURES, check_supported, folder_problem
from backends.tiny import TINY_LLM_ARCHITECTURES
from backends.tiny.llm import tiny_llm_config


@pytest.mark.parametrize("arch", TINY_LLM_ARCHITECTURES)
def test_every_tiny_architecture_is_supported(arch: str) -> None:
    check_supported(tiny_llm_config(arch).to_dict())


def test_an_unknown_architecture_is_an_input_error_listing_the_supported() -> None:
    with pytest.raises(InputError) as info:
        check_supported({"model_type": "gpt2"})
    message = str(info.value)
    assert "'gpt2' is not supported" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


def test_multimodal_and_bidirectional_configs_are_refused_with_a_hint() -> None:
    with pytest.raises(InputError, match="gemma3_text"):
        check_supported({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}})
    with pytest.raises(InputError, match="embedder"):
        check_supported({"model_type": "gemma3_text", "use_bidirectional_attention": True})


def test_folder_problem_reads_config_json_of_llms_only(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    problem = folder_problem(tmp_path, "llm")
    assert problem is not None and "gpt2" in problem
    assert folder_problem(tmp_path, "embedder") is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    assert folder_problem(tmp_path, "llm") is None
    (tmp_path / "config.json").write_text("{not json")
    assert "cannot read config.json" in (folder_problem(tmp_path, "llm") or "")
