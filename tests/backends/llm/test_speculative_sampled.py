"""Sampled output with speculation keeps the target's distribution: a chi-square test over
the first three tokens of a model with a six-token vocabulary, against the exact joint
distribution computed from the model's own logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.llm.sampling_params import SamplingParams
from tests.backends.llm.speculative_support import engine, ngram
from tests.backends.llm.support import run_all


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("speculative-models")


# ---- sampled output keeps the target's distribution ----------------------------------------
VOCAB = 6
TEMPERATURE = 0.8
SHARPEN = 2.0


def tiny_vocab_model(root: Path) -> Path:
    from transformers import LlamaForCausalLM

    from backends.tiny.llm import tiny_llm_config

    folder = root / "tiny-vocab"
    if not (folder / "config.json").is_file():
        ids = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}
        config = tiny_llm_config("llama", vocab_size=VOCAB, token_ids=ids, hidden_size=32)
        torch.manual_seed(7)
        model = LlamaForCausalLM(config)
        with torch.no_grad():  # sharper than the default init, so the draws are not uniform
            model.lm_head.weight.mul_(SHARPEN)
        model.save_pretrained(folder, safe_serialization=True)
    return folder


def target_distribution(folder: Path, prompt: list[int]) -> torch.Tensor:
    """The target's probability of each sequence of three tokens after `prompt`, (V^3,)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + p for p in prefixes])).logits
        return torch.softmax(logits[:, -1].double() / TEMPERATURE, dim=-1)  # (B, V)

    first = next_probs([[]])[0]  # (V,)
    pairs = [[a, b] for a in range(VOCAB) for b in range(VOCAB)]
    second = next_probs([[a] for a in range(VOCAB)])  # (V, V)
    third = next_probs(pairs)  # (V*V, V)
    joint = first[:, None, None] * second[:, :, None] * third.view(VOCAB, VOCAB, VOCAB)
    return joint.flatten()


def test_sampled_output_keeps_the_targets_distribution(root: Path) -> None:
    from scipy.stats import chisquare

    folder = tiny_vocab_model(root)
    prompt = [2, 4, 5, 0, 3, 1, 1, 1]
    expected = target_distribution(folder, prompt)
    samples = 3000
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=3, ignore_eos=True, n=8)
    e = engine(folder, ngram(2, max_batch=4096), max_num_seqs=512, max_num_batched_tokens=2048)
    torch.manual_seed(0)  # unseeded rows draw from torch's default generator
    results = run_all(e, [(prompt, params)] * (samples // 8))
    stats = e.metrics.speculation
    assert samples // 20 < stats.accepted < stats.proposed  # accepted and rejected drafts
    counts = torch.zeros(VOCAB**3, dtype=torch.float64)
    for c in (c for s in results for c in s):
        a, b, t = c.token_ids
        counts[(a * VOCAB + b) * VOCAB + t] += 1
    # Cells expected below 5 times are pooled into one.
    big = expected * samples >= 5
    observed = [*counts[big].tolist(), counts[~big].sum().item()]
    wanted = [*(expected[big] * samples).tolist(), (expected[~big] * samples).sum().item()]
    assert sum(big) > 8
    result = chisquare(observed, wanted)
    assert result.pvalue > 0.001, (result, stats.summary())
