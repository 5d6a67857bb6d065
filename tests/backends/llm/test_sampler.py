"""The sampler on hand-made logits (what each knob does) and the engine on a tiny model
(seeded sampling is reproducible whatever else shares the batch)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from backends.errors import InputError
from backends.llm.sampler import Sampler
from backends.llm.sampling_params import SamplingParams
from backends.llm.sequence import Sequence
from tests.backends.llm.support import build_model, make_engine, random_prompts, run_all

EOS = 1
V = 8


def seq(params: SamplingParams, output: list[int] | None = None, seq_id: int = 0) -> Sequence:
    s = Sequence(seq_id, "r", [2, 3], params, max_tokens=100, block_size=4)
    for t in output or []:
        s.append_token(t)
    return s


def logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def sample(params: SamplingParams, row: list[float], output: list[int] | None = None) -> int:
    return Sampler([EOS])(logits(row), [seq(params, output)]).token_ids[0]


FLAT = [0.0, 0.0, 1.0, 0.0, 2.0, 1.9, 0.0, 0.0]  # argmax 4, runner-up 5


def test_greedy_takes_the_argmax() -> None:
    assert sample(SamplingParams(temperature=0.0), FLAT) == 4


def test_plain_greedy_rows_pick_as_the_full_path_does() -> None:
    """Ties go to the first maximum and a NaN row to its first NaN, alone (the argmax-only
    path) or beside a row that asks for log-probabilities (the full path), on every row or
    on chosen ones."""
    rows = [
        [0.0, 3.0, 1.0, 3.0, 0.0, 0.0, 0.0, 0.0],
        [1.0, float("nan"), 2.0, float("nan"), 0.0, 0.0, 0.0, 0.0],
        [float("-inf")] * V,
        FLAT,
    ]
    greedy = SamplingParams(temperature=0.0)
    seqs = [seq(greedy, seq_id=i) for i in range(4)]
    plain = Sampler([EOS])(logits(*rows), seqs)
    assert plain.token_ids == [1, 1, 0, 4] and plain.logprobs == [None] * 4
    full = Sampler([EOS])(
        logits(*rows, FLAT), [*seqs, seq(SamplingParams(temperature=0.0, logprobs=1), seq_id=4)]
    )
    assert full.token_ids == [*plain.token_ids, 4]
    chosen = Sampler([EOS])(logits(*rows), seqs[:2], [3, 0])
    assert chosen.token_ids == [4, 1]


def test_logit_bias_and_min_tokens() -> None:
    assert sample(SamplingParams(temperature=0.0, logit_bias={6: 5.0}), FLAT) == 6
    eos_first = [0.0, 9.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]
    assert sample(SamplingParams(temperature=0.0), eos_first) == EOS
    banned = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(4,))
    assert sample(banned, eos_first, output=[7]) not in (EOS, 4)
    assert sample(banned, eos_first, output=[7, 7]) == EOS


def test_penalties() -> None:
    # A repetition penalty demotes tokens of the prompt (and output): 4 falls below 5.
    assert sample(SamplingParams(temperature=0.0, repetition_penalty=1.5), FLAT) == 4
    prompt_has_4 = Sequence(
        0,
        "r",
        [4],
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        max_tokens=9,
        block_size=4,
    )
    assert Sampler([EOS])(logits(FLAT), [prompt_has_4]).token_ids == [5]
    # Presence and frequency count the output only.
    assert sample(SamplingParams(temperature=0.0, presence_penalty=0.5), FLAT, output=[4]) == 5
    assert sample(SamplingParams(temperature=0.0, frequency_penalty=0.04), FLAT, output=[4]) == 4
    assert (
        sample(SamplingParams(temperature=0.0, frequency_penalty=0.04), FLAT, output=[4, 4, 4]) == 5
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1, seed=0),
        SamplingParams(temperature=1.0, top_p=0.01, seed=0),
        SamplingParams(temperature=1.0, min_p=0.99, seed=0),
    ],
)
def test_cuts_that_leave_one_token_behave_like_greedy(params: SamplingParams) -> None:
    sampler = Sampler([EOS])
    draws = {sampler(logits(FLAT), [seq(params, seq_id=i)]).token_ids[0] for i in range(50)}
    assert draws == {4}


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.05, 0.0, 0.1, 0.15, 0.2, 0.5, 0.0, 0.0])
    row = torch.log(probs.clamp_min(1e-30)).tolist()
    sampler = Sampler([EOS])
    counts: Counter[int] = Counter()
    draws = 4000
    s = seq(SamplingParams(temperature=1.0, seed=123))
    for _ in range(draws):
        counts[sampler(logits(row), [s]).token_ids[0]] += 1
    for token, p in enumerate(probs.tolist()):
        assert abs(counts[token] / draws - p) < 4 * math.sqrt(p * (1 - p) / draws) + 1e-9


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.0, 0.0, 0.1, 0.15, 0.25, 0.5, 0.0, 0.0])
    row = torch.log(probs.clamp_min(1e-30)).tolist()
    sampler = Sampler([EOS])
    s = seq(SamplingParams(temperature=1.0, top_p=0.7, seed=7))
    draws = {sampler(logits(row), [s]).token_ids[0] for _ in range(300)}
    assert draws == {4, 5}


def test_logprobs_are_the_model_distribution_with_the_top_alternatives() -> None:
    out = Sampler([EOS])(logits(FLAT), [seq(SamplingParams(temperature=0.0, logprobs=2))])
    [lp] = out.logprobs
    assert lp is not None
    expected = torch.log_softmax(logits(FLAT), dim=-1)[0]
    assert lp.token_id == 4 and lp.logprob == pytest.approx(expected[4].item())
    assert [t for t, _ in lp.top] == [4, 5]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 3.0),
        ("top_p", 0.0),
        ("top_k", -1),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("n", 0),
        ("logprobs", -1),
        ("seed", -5),
    ],
)
def test_out_of_range_values_name_the_field(field: str, value: float) -> None:
    with pytest.raises(InputError) as info:
        SamplingParams(**{field: value}).validate()  # type: ignore[arg-type]
    assert info.value.param == field


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("sampler-model"), "llama")


def test_same_seed_same_text_whatever_shares_the_batch(llama: Path) -> None:
    prompt = random_prompts(1, seed=5, lengths=(12, 12))[0]
    seeded = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=100, seed=1234, max_tokens=24, n=2, ignore_eos=True
    )
    alone = run_all(make_engine(llama), [(prompt, seeded)])[0]
    others = [
        (p, SamplingParams(temperature=t, seed=s, max_tokens=20, presence_penalty=0.5))
        for p, t, s in zip(
            random_prompts(9, seed=6, lengths=(2, 40)),
            [0.0, 0.7, 1.3] * 3,
            [None, 1234, 99] * 3,
            strict=True,
        )
    ]
    crowded = run_all(
        make_engine(llama, max_num_batched_tokens=64), [*others[:4], (prompt, seeded), *others[4:]]
    )[4]
    assert [c.token_ids for c in crowded] == [c.token_ids for c in alone]
    assert alone[0].token_ids != alone[1].token_ids, "the n samples draw differently"
    other_seed = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=100, seed=4321, max_tokens=24, ignore_eos=True
    )
    assert run_all(make_engine(llama), [(prompt, other_seed)])[0][0].token_ids != alone[0].token_ids
