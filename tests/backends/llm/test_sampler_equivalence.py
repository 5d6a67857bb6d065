"""The batched sampler gives the tokens and log-probabilities the sampler gave before its
step became batched device work: `ReferenceSampler` below is that sampler, kept as it was
(one Python pass and one device round trip per knob; grammar masks left out, both apply them
through the same `MaskFiller`). Over many steps of mixed batches whose composition changes,
greedy and seeded rows get the same tokens, and so do unseeded rows given the same global
generator state; log-probabilities agree to float tolerance.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import pytest
import torch

from backends.llm.sampler import Sampler, SamplerOutput
from backends.llm.sampling_params import SamplingParams
from backends.llm.sequence import Logprob, Sequence


class ReferenceSampler:
    """Samples rows of logits; keeps a generator per seeded sequence until `forget`."""

    def __init__(self, stop_token_ids: Iterable[int]) -> None:
        self.eos_token_ids = sorted(set(stop_token_ids))
        self._generators: dict[int, torch.Generator] = {}

    def forget(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._generators.pop(seq_id, None)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """`logits` (S, V), row i for `seqs[i]`."""
        logits = logits.float()
        want_logprobs = [s.params.logprobs is not None for s in seqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        if all(self._is_plain_greedy(s) for s in seqs):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, seqs)
        token_list: list[int] = tokens.tolist()
        logprobs: list[Logprob | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, tokens, seqs, want_logprobs)
        return SamplerOutput(token_list, logprobs)

    # ---- processing -------------------------------------------------------------------
    @staticmethod
    def _is_plain_greedy(seq: Sequence) -> bool:
        p = seq.params
        return (
            p.greedy
            and not p.logit_bias
            and seq.guide is None
            and not p.needs_penalties
            and seq.num_output_tokens >= p.min_tokens
        )

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        device = logits.device
        self._apply_bias_and_bans(logits, seqs)
        penalised = [i for i, s in enumerate(seqs) if s.params.needs_penalties]
        if penalised:
            _apply_penalties(logits, [seqs[i] for i in penalised], penalised)
        tokens = logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not rows:
            return tokens
        index = torch.tensor(rows, device=device)
        sub = logits[index]  # (R, V)
        params = [seqs[i].params for i in rows]
        temperature = torch.tensor([p.temperature for p in params], device=device)
        sub = sub / temperature[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            sub = _top_k_top_p(sub, params)
        probs = torch.softmax(sub, dim=-1)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)
            cut = probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(cut, 0.0)
        noise = torch.empty_like(probs)
        unseeded = []
        for r, i in enumerate(rows):
            seq = seqs[i]
            if seq.params.seed is None:
                unseeded.append(r)
                continue
            generator = self._generators.get(seq.seq_id)
            if generator is None:
                generator = torch.Generator(device=device)
                generator.manual_seed(seq.params.seed + seq.index)
                self._generators[seq.seq_id] = generator
            noise[r].exponential_(generator=generator)
        if unseeded:
            free = torch.tensor(unseeded, device=device)
            noise[free] = torch.empty(len(unseeded), probs.shape[1], device=device).exponential_()
        tokens[index] = (probs / noise).argmax(dim=-1)
        return tokens

    def _apply_bias_and_bans(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), device=logits.device)
                bias = torch.tensor(list(p.logit_bias.values()), device=logits.device)
                logits[i, ids] += bias
            if seq.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids)
                if not p.ignore_eos:
                    banned += self.eos_token_ids
                if banned:
                    logits[i, banned] = float("-inf")


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """vLLM's semantics: repetition over prompt and output, presence and frequency over the
    output only."""
    device, vocab = logits.device, logits.shape[1]
    index = torch.tensor(rows, device=device)
    sub = logits[index]  # (P, V)
    counts = _token_counts([s.output_token_ids for s in seqs], vocab, device)  # (P, V)
    seen = _token_counts([s.token_ids for s in seqs], vocab, device) > 0
    repetition = torch.tensor([s.params.repetition_penalty for s in seqs], device=device)[:, None]
    penalised = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(seen, penalised, sub)
    frequency = torch.tensor([s.params.frequency_penalty for s in seqs], device=device)[:, None]
    presence = torch.tensor([s.params.presence_penalty for s in seqs], device=device)[:, None]
    sub = sub - frequency * counts - presence * (counts > 0).to(sub.dtype)
    logits[index] = sub


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(len(token_lists), vocab) float counts of each token id per list."""
    width = max((len(t) for t in token_lists), default=0)
    # Pad with an extra id `vocab` that lands in a column dropped afterwards.
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
    for r, tokens in enumerate(token_lists):
        padded[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Keep each row's `top_k` best tokens and the smallest set reaching `top_p`."""
    device, vocab = logits.device, logits.shape[1]
    values, order = logits.sort(dim=-1, descending=True)  # (R, V)
    ranks = torch.arange(vocab, device=device)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    drop = ranks >= top_k[:, None]
    values = values.masked_fill(drop, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    probs = torch.softmax(values, dim=-1)
    # Drop a token once the tokens ranked above it already reach top_p; the best stays.
    before = probs.cumsum(dim=-1) - probs
    values = values.masked_fill(before > top_p, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, values)


def _gather_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence], wanted: list[bool]
) -> list[Logprob | None]:
    rows = [i for i, w in enumerate(wanted) if w]
    index = torch.tensor(rows, device=logprobs.device)
    sub = logprobs[index]  # (W, V)
    chosen = sub.gather(1, tokens[index][:, None])[:, 0].tolist()
    k = max(seqs[i].params.logprobs or 0 for i in rows)
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if k:
        top = sub.topk(k, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    out: list[Logprob | None] = [None] * len(seqs)
    token_list = tokens.tolist()
    for r, i in enumerate(rows):
        n = seqs[i].params.logprobs or 0
        pairs = tuple(zip(top_ids[r][:n], top_values[r][:n], strict=True))
        out[i] = Logprob(token_list[i], chosen[r], pairs)
    return out


EOS = 1
VOCAB = 1000


def random_params(rng: random.Random) -> SamplingParams:
    """A request mixing every knob the sampler has (grammar masks aside)."""
    temperature = rng.choice([0.0, 0.0, 0.7, 1.0, 1.3])
    return SamplingParams(
        temperature=temperature,
        top_k=rng.choice([0, 0, 5, 50]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.0, 0.05]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.3, -0.2]),
        logit_bias={rng.randrange(VOCAB): rng.uniform(-5, 5) for _ in range(rng.choice([0, 3]))},
        seed=rng.choice([None, rng.randrange(2**40)]),
        min_tokens=rng.choice([0, 0, 4]),
        stop_token_ids=tuple(rng.sample(range(VOCAB), rng.choice([0, 2]))),
        ignore_eos=rng.random() < 0.3,
        logprobs=rng.choice([None, None, 0, 3]),
    )


def new_seq(seq_id: int, rng: random.Random) -> Sequence:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
    params = random_params(rng)
    return Sequence(seq_id, f"r{seq_id}", prompt, params, max_tokens=10**6, block_size=4,
                    index=rng.randrange(3))  # fmt: skip


def assert_same(new: SamplerOutput, old: SamplerOutput) -> None:
    assert new.token_ids == old.token_ids
    for a, b in zip(new.logprobs, old.logprobs, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, rel=1e-6, abs=1e-6)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-6)


@pytest.mark.parametrize("ahead", [False, True], ids=["drawn-in-step", "drawn-ahead"])
@pytest.mark.parametrize("trial", range(4))
def test_batched_sampler_matches_the_reference_over_changing_batches(
    trial: int, ahead: bool
) -> None:
    rng = random.Random(trial)
    logits_gen = torch.Generator().manual_seed(trial)
    new, old = Sampler([EOS]), ReferenceSampler([EOS])
    new.noise.ahead = ahead
    # Each sampler keeps its own copies of the sequences, as each engine would.
    live: dict[int, tuple[Sequence, Sequence]] = {}
    next_id = 0
    for _step in range(14):
        while len(live) < rng.randrange(1, 12):
            a = new_seq(next_id, random.Random(next_id * 7919 + trial))
            b = new_seq(next_id, random.Random(next_id * 7919 + trial))
            live[next_id] = (a, b)
            next_id += 1
        ids = rng.sample(sorted(live), len(live))  # rows in a new order every step
        new.prepare([live[i][0] for i in ids])
        if rng.random() < 0.3:  # prepared, then only some rows sample (noise drawn ahead waits)
            ids = ids[: (len(ids) + 1) // 2]
        logits = torch.randn(len(ids), VOCAB, generator=logits_gen) * 4
        state = torch.get_rng_state()
        got = new(logits.clone(), [live[i][0] for i in ids])
        torch.set_rng_state(state)
        want = old(logits.clone(), [live[i][1] for i in ids])
        assert_same(got, want)
        for i, token in zip(ids, got.token_ids, strict=True):
            live[i][0].append_token(token)
            live[i][1].append_token(token)
        gone = [i for i in ids if rng.random() < 0.2]
        new.forget(gone)
        old.forget(gone)
        for i in gone:
            del live[i]


def test_a_token_the_engine_did_not_take_from_the_sampler_is_counted_as_appended() -> None:
    """Penalty counts follow the sequence's tokens, not the sampler's guess of them."""
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0)
    new, old = Sampler([EOS]), ReferenceSampler([EOS])
    a = Sequence(0, "r", [5, 6], params, max_tokens=99, block_size=4)
    b = Sequence(0, "r", [5, 6], params, max_tokens=99, block_size=4)
    gen = torch.Generator().manual_seed(3)
    for step in range(6):
        logits = torch.randn(1, VOCAB, generator=gen)
        got, want = new(logits.clone(), [a]), old(logits.clone(), [b])
        assert got.token_ids == want.token_ids
        # Every other step the engine appends a different token (and once, two of them).
        appended = [got.token_ids[0]] if step % 2 else [7, 8][: 1 + (step == 2)]
        for token in appended:
            a.append_token(token)
            b.append_token(token)


def test_rows_picks_the_sampling_rows_out_of_a_larger_batch() -> None:
    params = SamplingParams(temperature=1.0, seed=11, logprobs=2)
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(4))
    seqs = [Sequence(i, "r", [2], params, max_tokens=9, block_size=4) for i in range(2)]
    twins = [Sequence(i, "r", [2], params, max_tokens=9, block_size=4) for i in range(2)]
    got = Sampler([EOS])(logits.clone(), seqs, rows=[3, 1])
    assert_same(got, ReferenceSampler([EOS])(logits[[3, 1]], twins))
