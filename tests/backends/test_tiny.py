"""The tiny model builders: every folder loads offline with the stock libraries, behaves like a
model (varied greedy output, unit-length embeddings, one score per pair), holds safetensors
weights only, and is the same byte for byte when built again with the same seed."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from backends.tiny import (
    TINY_LLM_ARCHITECTURES,
    build_benchmark_llm,
    build_tiny_embedder,
    build_tiny_llm,
    build_tiny_reranker,
    build_tokenizer,
)
from backends.tiny.llm import benchmark_shape, tiny_llm_config
from backends.tiny.tokenizer import build_wordpiece_vocab

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The harbour town woke", "héllo wörld 日本 🙂", "What time does the train leave?"]
PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".pkl", ".ckpt"}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_safetensors_only(folder: Path) -> None:
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert not [p for p in files if p.suffix in PICKLE_SUFFIXES], files
    assert [p for p in files if p.suffix == ".safetensors"], files


@pytest.fixture(scope="module")
def llm_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-llms")
    return {arch: build_tiny_llm(root / arch, arch) for arch in TINY_LLM_ARCHITECTURES}


@pytest.mark.parametrize("arch", TINY_LLM_ARCHITECTURES)
def test_tiny_llm_loads_offline_and_greedy_output_varies(
    arch: str, llm_dirs: dict[str, Path]
) -> None:
    folder = llm_dirs[arch]
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert model.config.model_type == arch
    assert model.dtype == torch.float32

    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    out = model.generate(**batch, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    continuations = out[:, batch["input_ids"].shape[1] :]  # (prompts, 20)
    for prompt, row in zip(PROMPTS, continuations.tolist(), strict=True):
        assert len(set(row)) >= 5, f"{arch} repeats itself after {prompt!r}: {row}"
    assert len({tuple(row) for row in continuations.tolist()}) == len(PROMPTS)


@pytest.mark.parametrize("arch", TINY_LLM_ARCHITECTURES)
def test_tiny_llm_folder_is_small_safetensors_with_token_ids(
    arch: str, llm_dirs: dict[str, Path]
) -> None:
    folder = llm_dirs[arch]
    assert_safetensors_only(folder)
    assert (folder / "model.safetensors").stat().st_size < 5 * 1024 * 1024
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[name] == generation[name] == getattr(tokenizer, name)
    assert len(tokenizer) == config["vocab_size"]


@pytest.mark.parametrize("arch", TINY_LLM_ARCHITECTURES)
def test_tiny_llm_weights_depend_on_seed_only(
    arch: str, llm_dirs: dict[str, Path], tmp_path: Path
) -> None:
    again = build_tiny_llm(tmp_path / "again", arch)
    other_seed = build_tiny_llm(tmp_path / "other", arch, seed=1)
    original = sha256(llm_dirs[arch] / "model.safetensors")
    assert sha256(again / "model.safetensors") == original
    assert sha256(other_seed / "model.safetensors") != original
    assert sha256(again / "tokenizer.json") == sha256(llm_dirs[arch] / "tokenizer.json")


def test_gemma2_keeps_alternating_sliding_window_and_soft_caps(tmp_path: Path) -> None:
    folder = build_tiny_llm(tmp_path, "gemma2", config_overrides={"sliding_window": 16})
    config = AutoConfig.from_pretrained(folder)
    assert config.sliding_window == 16
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert config.attn_logit_softcapping and config.final_logit_softcapping

    # Generating well past the window exercises the sliding layers.
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(PROMPTS[0], return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    assert out.shape[1] == batch["input_ids"].shape[1] + 40


def test_mistral_has_a_sliding_window_that_can_be_overridden(tmp_path: Path) -> None:
    assert tiny_llm_config("mistral").sliding_window == 4096
    overridden = tiny_llm_config("mistral", config_overrides={"sliding_window": 32})
    assert overridden.sliding_window == 32


def test_unknown_arch_is_refused_with_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llama"):
        build_tiny_llm(tmp_path, "gpt-j")


def test_tokenizer_round_trips_any_unicode_and_renders_chat(tmp_path: Path) -> None:
    tokenizer = build_tokenizer(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert len(loaded) == 512
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token) == (
        "<|bos|>",
        "<|eos|>",
        "<|pad|>",
    )
    for text in ["héllo wörld 日本 🙂", "  two  spaces\ttab\nnewline", "ÅÄÖ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 👩‍👩‍👧"]:
        ids = loaded.encode(text, add_special_tokens=False)
        assert max(ids) < len(loaded)
        assert loaded.decode(ids) == text
    assert tokenizer.encode("hello") == loaded.encode("hello")

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    prompt = loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|bos|><|system|>\nBe brief.<|eos|>")
    assert prompt.endswith("<|user|>\nHi!<|eos|>\n<|assistant|>\n")
    closed = loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not closed.endswith("<|assistant|>\n")
    with pytest.raises(Exception, match="Unknown role: robot"):
        loaded.apply_chat_template([{"role": "robot", "content": "beep"}], tokenize=False)


def test_tokenizer_fills_larger_vocabularies_exactly(tmp_path: Path) -> None:
    tokenizer = build_tokenizer(tmp_path, vocab_size=1024)
    assert len(tokenizer) == 1024
    with pytest.raises(ValueError, match="too small"):
        build_tokenizer(tmp_path, vocab_size=100)


def test_tokenizers_are_identical_across_processes(tmp_path: Path) -> None:
    # The Rust trainers hash with a per-process random seed: compare with a fresh process.
    script = (
        "import hashlib, sys\n"
        "from pathlib import Path\n"
        "from backends.tiny.tokenizer import build_tokenizer, build_wordpiece_vocab\n"
        "for size in (512, 1024):\n"
        "    folder = Path(sys.argv[1], str(size))\n"
        "    build_tokenizer(folder, vocab_size=size)\n"
        "    print(hashlib.sha256((folder / 'tokenizer.json').read_bytes()).hexdigest())\n"
        "print(hashlib.sha256(repr(build_wordpiece_vocab()).encode()).hexdigest())\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "child")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    here = []
    for size in (512, 1024):
        build_tokenizer(tmp_path / str(size), vocab_size=size)
        here.append(sha256(tmp_path / str(size) / "tokenizer.json"))
    here.append(hashlib.sha256(repr(build_wordpiece_vocab()).encode()).hexdigest())
    assert child.stdout.split() == here


def test_embedder_loads_in_sentence_transformers_and_gives_unit_vectors(tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    folder = build_tiny_embedder(tmp_path / "embedder")
    assert_safetensors_only(folder)
    modules = json.loads((folder / "modules.json").read_text())
    assert [m["path"] for m in modules] == ["", "1_Pooling", "2_Normalize"]
    assert json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"] == 128
    assert json.loads((folder / "1_Pooling/config.json").read_text())["pooling_mode_mean_tokens"]

    model = SentenceTransformer(str(folder), device="cpu")
    texts = ["The train leaves at ten.", "Sunflowers grew tall.", "héllo 日本 🙂", "word " * 300]
    vectors = model.encode(texts, convert_to_tensor=True)  # (4, 32)
    assert vectors.shape == (4, 32)
    assert torch.allclose(vectors.norm(dim=-1), torch.ones(4), atol=1e-5)
    similarity = vectors @ vectors.T
    assert similarity[0, 1] < 0.99  # different texts, different vectors

    again = build_tiny_embedder(tmp_path / "again")
    assert sha256(again / "model.safetensors") == sha256(folder / "model.safetensors")


def test_embedder_without_normalize_has_no_normalize_module(tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    folder = build_tiny_embedder(tmp_path, hidden_size=64, normalize=False, max_seq_length=64)
    modules = json.loads((folder / "modules.json").read_text())
    assert [m["path"] for m in modules] == ["", "1_Pooling"]
    model = SentenceTransformer(str(folder), device="cpu")
    assert model.max_seq_length == 64
    vectors = model.encode(["one", "two"], convert_to_tensor=True)
    assert vectors.shape == (2, 64)
    assert not torch.allclose(vectors.norm(dim=-1), torch.ones(2), atol=1e-3)


def test_reranker_loads_in_cross_encoder_and_scores_each_pair(tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder

    folder = build_tiny_reranker(tmp_path / "reranker")
    assert_safetensors_only(folder)
    model = CrossEncoder(str(folder), device="cpu")
    pairs = [
        ("when does the train leave", "The train left at 10:45 from platform 3."),
        ("when does the train leave", "Gulls argued over the night's catch."),
        ("who kept the lighthouse", "Mara kept the lighthouse for twenty-one years."),
    ]
    scores = model.predict(pairs)
    assert len(scores) == len(pairs)
    assert all(math.isfinite(float(s)) for s in scores)
    assert len({round(float(s), 6) for s in scores}) == len(pairs)

    again = build_tiny_reranker(tmp_path / "again")
    assert sha256(again / "model.safetensors") == sha256(folder / "model.safetensors")


@pytest.mark.parametrize("target", [25_000_000, 100_000_000])
def test_benchmark_shape_lands_within_15_percent_of_target(target: int) -> None:
    shape = benchmark_shape(target)
    config = tiny_llm_config(
        "llama",
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        vocab_size=8192,
        intermediate_size=shape.intermediate_size,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == shape.num_parameters()
    assert abs(counted - target) <= 0.15 * target


def test_benchmark_llm_builds_the_planned_shape(tmp_path: Path) -> None:
    # The smallest benchmark shape keeps this test's file near 20 MB.
    target = 6_000_000
    folder = build_benchmark_llm(tmp_path, target_params=target)
    assert_safetensors_only(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert sum(p.numel() for p in model.parameters()) == benchmark_shape(target).num_parameters()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == model.config.vocab_size
    batch = tokenizer(PROMPTS[0], return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.shape[1] == batch["input_ids"].shape[1] + 8
