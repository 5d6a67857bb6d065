"""The fast transformers loader: the same model as `from_pretrained`, without initialising
weights it overwrites, and without touching models built in other threads."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from backends.errors import LoadError
from backends.loading import load_causal_lm, skip_parameter_init
from backends.tiny import build_tiny_llm
from tests.support.checkpoints import drop_tensor


def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits  # type: ignore[no-any-return]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied and tied output heads
def test_fast_load_matches_from_pretrained(tmp_path: Path, arch: str) -> None:
    folder = build_tiny_llm(tmp_path / arch, arch)
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    model = load_causal_lm(folder, "cpu")
    ids = [5, 17, 99, 3, 42]
    assert torch.equal(logits(model, ids), logits(reference, ids))
    assert dict(model.named_buffers()).keys() == dict(reference.named_buffers()).keys()
    if arch == "qwen2":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(p.requires_grad for p in model.parameters())
    assert model.generation_config.eos_token_id == reference.generation_config.eos_token_id


def test_fast_load_takes_an_attention_implementation(tiny_llm_dir: Path) -> None:
    model = load_causal_lm(tiny_llm_dir, "cpu", attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    reference = AutoModelForCausalLM.from_pretrained(tiny_llm_dir, attn_implementation="eager")
    assert torch.equal(logits(model, [4, 5, 6]), logits(reference.eval(), [4, 5, 6]))


def test_fast_load_casts_to_the_requested_dtype(tiny_llm_dir: Path) -> None:
    model = load_causal_lm(tiny_llm_dir, "cpu", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    reference = AutoModelForCausalLM.from_pretrained(tiny_llm_dir, dtype=torch.bfloat16)
    ids = [1, 2, 3]
    assert torch.equal(logits(model, ids), logits(reference.eval(), ids))


def test_skipping_parameter_init_is_local_to_the_thread() -> None:
    inside, release = threading.Event(), threading.Event()

    def build_without_init() -> None:
        with skip_parameter_init():
            inside.set()
            release.wait(10)

    other = threading.Thread(target=build_without_init)
    other.start()
    inside.wait(10)
    try:
        torch.manual_seed(0)
        here = torch.nn.Linear(8, 8).weight.detach().clone()
    finally:
        release.set()
        other.join()
    torch.manual_seed(0)
    assert torch.equal(here, torch.nn.Linear(8, 8).weight)  # initialised as usual
    # In the thread that asked, no random initialisation ran: the RNG was never drawn from.
    torch.manual_seed(0)
    with skip_parameter_init():
        torch.nn.Linear(64, 64)
    drawn = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(drawn, torch.rand(1))


def test_a_checkpoint_missing_weights_of_its_config_fails_to_load(tmp_path: Path) -> None:
    # A config declaring 4 layers over a 2-layer checkpoint: the other layers would be random.
    folder = build_tiny_llm(tmp_path / "llm", "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    with pytest.raises(LoadError, match=r"lacks \d+ weights") as e:
        load_causal_lm(folder, "cpu")
    assert "layers.2." in str(e.value)


def test_tied_output_weights_are_not_missing(tmp_path: Path) -> None:
    # tie_word_embeddings: the checkpoint holds the embedding once; the head shares it.
    folder = build_tiny_llm(tmp_path / "llm", "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    drop_tensor(folder / "model.safetensors", "lm_head.weight")
    model = load_causal_lm(folder, "cpu")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
