"""The trained pair (its quick variant): the target predicts held-out standard-library code far
better than a unigram guess, the draft agrees with it on many positions (what speculative
decoding accepts), both folders load offline in transformers, and the hub's engine decodes
the target greedily exactly as transformers does. A second build call reuses the cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from backends.llm.sampling_params import SamplingParams
from backends.tiny.stdlib_corpus import stdlib_corpus
from backends.tiny.trained import QUICK_PAIR, TrainedPair, build_trained_pair
from tests.backends.llm.support import greedy_with_tops, make_engine, run_all

MAX_TOKENS = 16
TOP = 5


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> TrainedPair:
    return build_trained_pair(QUICK_PAIR, tmp_path_factory.mktemp("trained-pair"), progress=False)


@pytest.fixture(scope="module")
def held_out(pair: TrainedPair) -> torch.Tensor:
    """Held-out stdlib code as 24 windows of 64 tokens, spread over the held-out files."""
    tokenizer = AutoTokenizer.from_pretrained(pair.target, local_files_only=True)
    texts = stdlib_corpus(QUICK_PAIR.train_chars, QUICK_PAIR.held_out_chars).held_out
    ids = [t for text in texts for t in tokenizer.encode(text, add_special_tokens=False)]
    stride = len(ids) // 24
    return torch.tensor([ids[i * stride : i * stride + 65] for i in range(24)])


def test_pair_predicts_held_out_code_and_the_draft_agrees_with_the_target(
    pair: TrainedPair, held_out: torch.Tensor
) -> None:
    target = AutoModelForCausalLM.from_pretrained(pair.target, local_files_only=True)
    draft = AutoModelForCausalLM.from_pretrained(pair.draft, local_files_only=True)
    assert draft.num_parameters() * 2 < target.num_parameters()
    assert (pair.target / "tokenizer.json").read_bytes() == (
        pair.draft / "tokenizer.json"
    ).read_bytes()

    inputs, labels = held_out[:, :-1], held_out[:, 1:]
    with torch.inference_mode():
        target_top = target(input_ids=inputs).logits.argmax(-1)
        draft_top = draft(input_ids=inputs).logits.argmax(-1)
    unigram = float((labels == torch.mode(labels.flatten()).values).float().mean())
    target_accuracy = float((target_top == labels).float().mean())
    agreement = float((draft_top == target_top).float().mean())
    print(f"target {target_accuracy:.3f}, unigram {unigram:.3f}, agreement {agreement:.3f}")
    # Unigram here is the held-out text's own most frequent token: a generous baseline.
    assert target_accuracy > 2 * unigram
    assert agreement > 0.3
    assert pair.report["target_accuracy"] > 2 * pair.report["unigram_accuracy"]


def test_engine_greedy_output_equals_transformers_on_both_models(
    pair: TrainedPair, held_out: torch.Tensor
) -> None:
    prompts = [row[: 8 + 8 * i].tolist() for i, row in enumerate(held_out[:4])]
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP))
                for p in prompts]  # fmt: skip
    for folder in (pair.target, pair.draft):
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager", local_files_only=True
        )
        refs = greedy_with_tops(model, prompts, MAX_TOKENS, TOP)
        engine = make_engine(folder, max_num_seqs=8)
        results = run_all(engine, requests)
        exact = 0
        for (hf_tokens, hf_tops), [ours] in zip(refs, results, strict=True):
            if ours.token_ids == hf_tokens:
                exact += 1
                continue
            # Only a numeric near-tie may flip a token: each side's among the other's top 5.
            i = next(
                i for i, (a, b) in enumerate(zip(hf_tokens, ours.token_ids, strict=False)) if a != b
            )
            our_top = {t for t, _ in ours.logprobs[i].top}
            assert ours.token_ids[i] in hf_tops[i] and hf_tokens[i] in our_top, (folder, i)
        assert exact >= len(prompts) - 1, f"{folder.name}: {exact}/{len(prompts)} exact"


def test_second_build_reuses_the_cached_pair(pair: TrainedPair) -> None:
    weights = pair.target / "model.safetensors"
    before = weights.stat().st_mtime_ns
    again = build_trained_pair(QUICK_PAIR, pair.target.parents[1], progress=False)
    assert again == pair
    assert weights.stat().st_mtime_ns == before
