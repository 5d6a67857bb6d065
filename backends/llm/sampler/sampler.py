"""Logits to tokens, one row per sequence that samples in the step.

Order of work on a row: log-probabilities of the raw model distribution (what `logprobs`
reports), then the grammar mask of a structured request (disallowed tokens to -inf; the mask
is filled while the model runs, see `prepare`), then logit bias, the min_tokens ban on stop
tokens, repetition / presence / frequency penalties; greedy rows take the argmax, the others
are divided by their temperature, cut by top-k, top-p and min-p, and sampled. Sampling uses
the exponential race (`argmax(p / E)`, E ~ Exp(1)), which draws exactly `vocab` numbers per
token: a seeded sequence owns a generator that advances the same way whatever else is in the
batch, so the same seed gives the same text in any batch (a grammar mask changes which
tokens can win, never the draws). A batch of plain greedy rows costs one argmax.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from backends.llm.sampling_params import SamplingParams
from backends.llm.sequence import Logprob, Sequence
from backends.llm.structured.guide import MaskFiller


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: None unless the sequence asked for log-probabilities.
    logprobs: list[Logprob | None]


class Sampler:
    """Samples rows of logits; keeps a generator per seeded sequence until `forget`."""

    def __init__(self, stop_token_ids: Iterable[int]) -> None:
        self.eos_token_ids = sorted(set(stop_token_ids))
        self._generators: dict[int, torch.Generator] = {}
        self.masks = MaskFiller()

    def prepare(self, seqs: list[Sequence]) -> None:
        """Called before the forward pass of the step that will sample `seqs`: starts
        filling the grammar masks of constrained rows so they are ready with the logits."""
        self.masks.start(seqs)

    def forget(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._generators.pop(seq_id, None)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """`logits` (S, V), row i for `seqs[i]`."""
        logits = logits.float()
        want_logprobs = [s.params.logprobs is not None for s in seqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        self.masks.apply(logits, seqs)
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
