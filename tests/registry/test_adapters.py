"""A LoRA adapter version records its base: the alias given at registration resolved to a
version, in SQL and in the MLflow version's tags; the record stays when the alias moves."""

from __future__ import annotations

from pathlib import Path

import pytest

from registry.errors import InvalidSourceError
from registry.service import Registry
from registry.views import BaseRef


@pytest.fixture(scope="module")
def adapter_dir(tiny_llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.backends.llm.lora_support import ATTENTION, build_adapter

    return build_adapter(tiny_llm_dir, tmp_path_factory.mktemp("registry-lora"), ATTENTION)


def test_an_adapter_records_its_resolved_base(
    registry: Registry, tiny_llm_dir: Path, adapter_dir: Path
) -> None:
    registry.register("tiny", "llm", str(tiny_llm_dir), aliases=["production"])
    registry.register("tiny", "llm", str(tiny_llm_dir))
    view = registry.register("bot", "llm", str(adapter_dir), base="tiny@production")
    assert view.base == BaseRef("tiny", 1) and view.is_adapter
    assert view.dtype == "float32" and "adapter_model.safetensors" in view.manifest
    tags = registry.mlflow.client.get_model_version("bot", "1").tags
    assert tags["hub.base"] == "tiny@1"

    registry.set_alias("tiny", "production", 2, actor="test")
    assert registry.get_version("bot", 1).base == BaseRef("tiny", 1)  # trained against v1
    assert registry.get_version("tiny", 2).base is None

    with pytest.raises(InvalidSourceError, match="has no version or alias 'staging'"):
        registry.register("bot", "llm", str(adapter_dir), base="tiny@staging")
    assert sorted(registry.get_model("bot").versions) == [1]  # the refusal left nothing
