"""Checking a PEFT adapter folder before it is served (what registration answers 400 with):
what is read from it, and every refusal naming its cause."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from backends.llm.lora import AdapterError, adapter_bytes, check_adapter_fits, read_adapter
from tests.backends.llm.lora_support import ALL_LINEAR, ATTENTION, build_adapter, edit_config
from tests.backends.llm.support import build_model


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora-adapter")


@pytest.fixture(scope="module")
def llama(root: Path) -> Path:
    return build_model(root, "llama")


@pytest.fixture(scope="module")
def attention_adapter(root: Path, llama: Path) -> Path:
    return build_adapter(llama, root / "attn", ATTENTION, r=4, alpha=16)


def test_an_adapter_that_fits_is_read_with_its_shapes_and_scaling(
    root: Path, llama: Path, attention_adapter: Path
) -> None:
    spec = read_adapter(attention_adapter)
    check_adapter_fits(spec, llama)
    assert spec.rank == 4 and not spec.use_rslora
    assert len(spec.modules) == 2 * 4  # two layers, four projections
    q = next(m for m in spec.modules if m.module == "model.layers.0.self_attn.q_proj")
    assert (q.rank, q.in_features, q.out_features, q.scaling) == (4, 64, 64, 16 / 4)
    # Device bytes: A and B of every module, twice (its slot and the step's stacked copy).
    elements = sum(m.rank * (m.in_features + m.out_features) for m in spec.modules)
    assert adapter_bytes(spec) == 2 * 4 * elements
    assert adapter_bytes(spec, element_size=2) == 2 * 2 * elements

    rs = read_adapter(build_adapter(llama, root / "rs", ALL_LINEAR, r=8, use_rslora=True))
    check_adapter_fits(rs, llama)
    assert len(rs.modules) == 2 * 7 and rs.use_rslora
    assert all(math.isclose(m.scaling, 16 / math.sqrt(8)) for m in rs.modules)


def test_an_adapter_of_another_model_does_not_fit(root: Path, llama: Path) -> None:
    from backends.tiny import build_tiny_llm

    wider = build_tiny_llm(root / "wider", "llama", config_overrides={"intermediate_size": 96})
    spec = read_adapter(build_adapter(wider, root / "wider-all", ALL_LINEAR))
    with pytest.raises(AdapterError, match=r"mlp\.(gate|up|down)_proj.*another model size"):
        check_adapter_fits(spec, llama)

    phi3 = build_model(root, "phi3")  # fused qkv_proj: a module Llama does not have
    spec = read_adapter(build_adapter(phi3, root / "phi3-attn", ["qkv_proj"]))
    with pytest.raises(AdapterError, match=r"does not have.*qkv_proj.*another architecture"):
        check_adapter_fits(spec, llama)


def test_unsupported_peft_features_are_refused_by_name(root: Path, llama: Path) -> None:
    dora = build_adapter(llama, root / "dora", ATTENTION, use_dora=True)
    with pytest.raises(AdapterError, match="use_dora: DoRA"):
        read_adapter(dora)
    pickled = build_adapter(llama, root / "pickled", ATTENTION, safe=False)
    with pytest.raises(AdapterError, match=r"only adapter_model\.bin \(a pickle"):
        read_adapter(pickled)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"layer_replication": [[0, 2]]}, "layer_replication"),
        ({"bias": "all"}, "bias='all'"),
        ({"peft_type": "IA3"}, "peft_type 'IA3'"),
        ({"target_modules": ["q_proj", "lm_head"]}, r"target_modules \['lm_head'\]"),
        ({"r": 8}, "rank 4 but adapter_config.json says r=8"),
    ],
)
def test_config_fields_that_cannot_be_served_are_named(
    change: dict[str, object], message: str, tmp_path: Path, attention_adapter: Path
) -> None:
    folder = Path(shutil.copytree(attention_adapter, tmp_path / "edited"))
    edit_config(folder, **change)
    with pytest.raises(AdapterError, match=message):
        read_adapter(folder)


def test_a_rank_above_the_bound_is_refused(attention_adapter: Path) -> None:
    with pytest.raises(AdapterError, match="rank 4 exceeds the largest supported rank 2"):
        read_adapter(attention_adapter, max_rank=2)
