"""The typed runtime configs: every documented key is accepted, unknown keys and bad values
are refused naming the key, values are typed once, and backends build from them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from backends.encoders.batch_limits import BatchLimits
from backends.runtime_config import (
    EmbedderConfig,
    EncoderConfig,
    LLMConfig,
    RerankerConfig,
    RuntimeConfig,
    RuntimeConfigError,
    parse_runtime_config,
)
from backends.units import parse_bytes, parse_duration

DOCS = Path(__file__).resolve().parents[2] / "docs"


def readme_table_keys(heading: str, page: str) -> set[str]:
    """The backticked keys in the first column of the first table after the line of
    docs/`page` that starts with `heading`."""
    lines = (DOCS / page).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    keys: set[str] = set()
    in_table = False
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            in_table = True
            first = line.split("|")[1]
            keys.update(re.findall(r"`([a-z_]+)`", first))
        elif in_table:
            break
    return keys


def test_every_key_the_readme_documents_is_a_field_of_its_kind() -> None:
    encoder = readme_table_keys("Per-version runtime settings", "encoders.md")
    llm = readme_table_keys("Engine settings are a model version's runtime", "engine.md")
    assert {"max_batch_size", "max_documents", "matryoshka_dims"} <= encoder
    assert {"kv_cache_bytes", "max_num_seqs", "dtype"} <= llm
    assert encoder - {"max_documents", "matryoshka_dims"} <= set(EncoderConfig.model_fields)
    assert encoder - {"max_documents"} <= set(EmbedderConfig.model_fields)
    assert encoder - {"matryoshka_dims"} <= set(RerankerConfig.model_fields)
    assert llm <= set(LLMConfig.model_fields)
    shared = {"keep_alive", "pin", "device", "dtype"}
    for cls in (EmbedderConfig, RerankerConfig, LLMConfig):
        assert shared <= set(cls.model_fields)


@pytest.mark.parametrize(
    ("kind", "config", "key", "why"),
    [
        ("embedder", {"max_batch_sizee": 1}, "max_batch_sizee", "unknown key for an embedder"),
        ("embedder", {"max_batch_size": -3}, "max_batch_size", "greater than or equal to 1"),
        ("embedder", {"max_batch_size": "64"}, "max_batch_size", "valid integer"),
        ("embedder", {"max_batch_size": 2.5}, "max_batch_size", "valid integer"),
        ("embedder", {"batch_wait_ms": float("nan")}, "batch_wait_ms", "finite"),
        ("embedder", {"batch_wait_ms": True}, "batch_wait_ms", "valid number"),
        ("embedder", {"unpadded": "yes"}, "unpadded", "valid boolean"),
        ("embedder", {"matryoshka_dims": []}, "matryoshka_dims", "at least 1"),
        ("embedder", {"matryoshka_dims": [0]}, "matryoshka_dims.0", "greater than or equal"),
        ("embedder", {"max_documents": 5}, "max_documents", "unknown key for an embedder"),
        ("reranker", {"max_documents": "many"}, "max_documents", "valid integer"),
        ("reranker", {"max_documents": 0}, "max_documents", "greater than or equal to 1"),
        ("reranker", {"batch_overhead_tokens": -1}, "batch_overhead_tokens", "greater than"),
        ("reranker", {"matryoshka_dims": [8]}, "matryoshka_dims", "unknown key for a reranker"),
        ("llm", {"max_batch_size": 8}, "max_batch_size", "unknown key for an LLM"),
        ("llm", {"kv_cache_bytes": "lots"}, "kv_cache_bytes", "not a byte size"),
        ("llm", {"kv_cache_bytes": 0}, "kv_cache_bytes", "greater than 0"),
        ("llm", {"kv_cache_fraction": 0}, "kv_cache_fraction", "greater than 0"),
        ("llm", {"kv_cache_fraction": 1}, "kv_cache_fraction", "less than 1"),
        ("llm", {"kv_cache_bytes": "1MiB", "kv_cache_fraction": 0.5}, "kv_cache_fraction",
         "either kv_cache_bytes or kv_cache_fraction"),
        ("llm", {"max_num_seqs": 600}, "max_num_batched_tokens", "below max_num_seqs=600"),
        ("llm", {"enable_prefix_caching": 1}, "enable_prefix_caching", "valid boolean"),
        ("llm", {"keep_alive": "soon"}, "keep_alive", "not a duration"),
        ("llm", {"keep_alive": float("inf")}, "keep_alive", "finite"),
        ("llm", {"pin": "true"}, "pin", "valid boolean"),
        ("llm", {"device": "gpu0"}, "device", "'cpu' or 'cuda:N'"),
        ("llm", {"dtype": "float8"}, "dtype", "unknown dtype"),
    ],
)  # fmt: skip
def test_bad_configs_name_the_key_and_why(
    kind: str, config: dict[str, Any], key: str, why: str
) -> None:
    with pytest.raises(RuntimeConfigError) as e:
        parse_runtime_config(kind, config)
    assert e.value.key == key
    assert why in e.value.reason
    assert f"{key}: " in str(e.value)


def test_every_problem_is_named_not_only_the_first() -> None:
    with pytest.raises(RuntimeConfigError) as e:
        parse_runtime_config("reranker", {"max_documentz": 1, "max_queue": 0})
    assert e.value.key in {"max_documentz", "max_queue"}
    assert "max_documentz" in str(e.value) and "max_queue" in str(e.value)


def test_a_misspelled_key_gets_the_likely_one_suggested() -> None:
    with pytest.raises(RuntimeConfigError, match="did you mean 'max_batch_size'"):
        parse_runtime_config("embedder", {"max_batch_sizee": 64})
    with pytest.raises(RuntimeConfigError) as e:
        parse_runtime_config("llm", {"zzz": 1})
    assert "did you mean" not in str(e.value)


def test_values_are_typed_once() -> None:
    llm = parse_runtime_config("llm", {"kv_cache_bytes": "64MiB", "keep_alive": "5m"})
    assert isinstance(llm, LLMConfig)
    assert (llm.kv_cache_bytes, llm.keep_alive) == (64 * 2**20, 300.0)
    assert (llm.block_size, llm.max_num_seqs, llm.kv_cache_fraction) == (16, 64, None)
    emb = parse_runtime_config("embedder", {"matryoshka_dims": [64, 256, 64, 128]})
    assert emb.matryoshka_dims == [256, 128, 64]  # largest first, once each
    assert emb.forward_workers is None and emb.unpadded is None  # left to the device
    assert parse_runtime_config("reranker", None).max_documents == 1000
    assert parse_runtime_config("embedder", {"keep_alive": -1}).keep_alive == -1.0


def test_typed_configs_are_frozen_and_pass_through() -> None:
    config = parse_runtime_config("reranker", {"max_documents": 3})
    with pytest.raises(ValidationError):
        config.max_documents = 4
    assert parse_runtime_config("reranker", config) is config
    assert RerankerConfig.parse(config) is config
    with pytest.raises(RuntimeConfigError, match="not the runtime config of an LLM"):
        LLMConfig.parse(config)
    with pytest.raises(RuntimeConfigError, match="mapping"):
        parse_runtime_config("llm", ["kv_cache_bytes"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown kind 'vision'"):
        parse_runtime_config("vision", {})


def test_the_shared_base_reads_deployment_keys_alone() -> None:
    base = RuntimeConfig.parse({"device": "cuda:1", "keep_alive": "90s", "pin": True})
    assert (base.device, base.keep_alive, base.pin, base.dtype) == ("cuda:1", 90.0, True, None)
    with pytest.raises(RuntimeConfigError, match="max_documents"):
        RuntimeConfig.parse({"max_documents": 1})


def test_one_byte_size_and_duration_parser() -> None:
    assert parse_bytes("64MiB") == 64 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes(" 2 TiB ") == 2 * 2**40
    assert parse_bytes(1024) == 1024
    for bad in ("lots", "-1MiB", -5, True, float("inf"), None):
        with pytest.raises(ValueError):
            parse_bytes(bad)  # type: ignore[arg-type]
    assert parse_duration("250ms") == 0.25
    assert parse_duration("-1") == -1.0
    for bad in ("soon", float("nan"), True, None):
        with pytest.raises(ValueError):
            parse_duration(bad)  # type: ignore[arg-type]
    import hub.units

    assert hub.units.parse_bytes is parse_bytes  # the hub's name for the same parser


def test_batch_limits_and_engine_config_come_from_the_typed_config() -> None:
    from backends.llm.config import EngineConfig

    limits = BatchLimits.from_config(
        RerankerConfig.parse({"max_batch_size": 4, "batch_wait_ms": 0.5, "max_queue": 9})
    )
    assert (limits.max_batch_size, limits.batch_wait_s, limits.max_queue) == (4, 0.0005, 9)
    assert BatchLimits.from_config(RerankerConfig()) == BatchLimits()
    engine = EngineConfig.from_runtime_config(
        LLMConfig.parse({"kv_cache_fraction": 0.25, "max_n": 2}), device_budget_bytes=4000
    )
    assert (engine.kv_cache_bytes, engine.max_n, engine.block_size) == (1000, 2, 16)
    assert EngineConfig.from_runtime_config(LLMConfig()) == EngineConfig()
