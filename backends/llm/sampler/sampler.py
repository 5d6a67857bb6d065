"""The sampler: a step's logits to its tokens (and log-probabilities), as batched tensor work
on the logits' device with one copy to the host."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from backends.llm.sampler.noise import SeededNoise
from backends.llm.sampler.penalties import PenaltyCounts
from backends.llm.sampler.plan import StepPlan
from backends.llm.sampler.transfer import download, upload_fields
from backends.llm.sequence import Logprob, Sequence
from backends.llm.structured.guide import MaskFiller


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: None unless the sequence asked for log-probabilities.
    logprobs: list[Logprob | None]


class Sampler:
    """Samples rows of logits; keeps per-sequence state (a seeded sequence's generator, a
    penalised one's token counts) until `forget`."""

    def __init__(self, stop_token_ids: Iterable[int]) -> None:
        self.eos_token_ids = sorted(set(stop_token_ids))
        self.masks = MaskFiller()
        self.noise = SeededNoise()
        self.penalties = PenaltyCounts()

    def prepare(self, seqs: list[Sequence]) -> None:
        """Called before the forward pass of the step that will sample `seqs`: starts
        filling the grammar masks of constrained rows, and off the CPU drawing the noise of
        seeded rows, so both are ready with the logits."""
        self.masks.start(seqs)
        self.noise.start(seqs)

    @staticmethod
    def greedy_only(seqs: list[Sequence]) -> bool:
        """Whether every row of `seqs` is its logits' argmax and nothing else (no
        log-probabilities, bias, penalties, grammar or min_tokens ban): a caller may then
        take the argmax itself, with nothing to record here."""
        return all(map(_plain_greedy, seqs))

    def forget(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self.noise.forget(seq_id)
            self.penalties.forget(seq_id)

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int] | None = None
    ) -> SamplerOutput:
        """Row i of `logits` (N, V) for `seqs[i]`, or row `rows[i]` where given. Waits for the
        device once, on the copy of the result."""
        if not seqs:
            return SamplerOutput([], [])
        if all(map(_plain_greedy, seqs)):
            return SamplerOutput(_argmax(logits, rows), [None] * len(seqs))
        device, vocab = logits.device, logits.shape[1]
        plan = StepPlan.build(seqs, self.eos_token_ids, vocab)
        ints, floats = plan.fields()
        ints["rows"] = rows or []  # left out when empty
        if plan.penalised:
            penalised = [seqs[i] for i in plan.penalised]
            ints["slots"] = self.penalties.slots_for(penalised, vocab, device)
        t = upload_fields(ints, floats, device)
        if rows:
            logits = logits.index_select(0, t["rows"])
        logits = logits.float()
        raw_logprobs = None  # (W, V) of the model's own distribution, before any processing
        if plan.logprob_rows:
            wanted = logits if len(plan.logprob_rows) == len(seqs) else logits[t["logprob_rows"]]
            raw_logprobs = torch.log_softmax(wanted, dim=-1)
        self.masks.apply(logits, seqs)
        greedy = plan.plain_greedy
        tokens = logits.argmax(dim=-1) if greedy else self._sample(logits, seqs, plan, t)
        host = download(_pack(tokens, raw_logprobs, t.get("logprob_rows"), plan.top_logprobs))
        token_ids, logprobs = _unpack(host, seqs, plan)
        if plan.penalised:
            self.penalties.count(
                [seqs[i] for i in plan.penalised],
                t["slots"],
                tokens[t["penalised"]],
                [token_ids[i] for i in plan.penalised],
            )
        return SamplerOutput(token_ids, logprobs)

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence], plan: StepPlan, t: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Bias and bans, penalties, then greedy rows by argmax and the others by the race."""
        vocab = logits.shape[1]
        if plan.bias_rows:
            logits.index_put_((t["bias_rows"], t["bias_ids"]), t["bias_values"], accumulate=True)
        if plan.penalised:
            index = t["penalised"]
            sub = logits[index]  # (P, V)
            sub = self.penalties.apply(
                sub, t["slots"], t["repetition"], t["frequency"], t["presence"]
            )
            logits.index_copy_(0, index, sub)
        tokens = logits.argmax(dim=-1)
        if not plan.sampled:
            return tokens
        index = t["sampled"]
        sub = logits[index] / t["temperature"][:, None]  # (R, V)
        if plan.cut:
            cut = t["cut"]
            sub.index_copy_(0, cut, _top_k_top_p(sub[cut], t["top_k"], t["top_p"]))
        probs = torch.softmax(sub, dim=-1)
        if plan.any_min_p:
            floor = t["min_p"][:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        sampled = [seqs[i] for i in plan.sampled]
        noise = self.noise.draw(sampled, plan.seeded, plan.unseeded, vocab, logits.device, t)
        tokens.index_copy_(0, index, (probs / noise).argmax(dim=-1))
        return tokens


def _plain_greedy(seq: Sequence) -> bool:
    """Whether the row of `seq` is its logits' argmax and nothing else: greedy, no
    log-probabilities, bias, penalties or grammar, and no min_tokens ban in force."""
    p = seq.params
    return (
        p.plain_greedy
        and seq.guide is None
        and (not p.min_tokens or seq.num_output_tokens >= p.min_tokens)
    )


def _argmax(logits: torch.Tensor, rows: list[int] | None) -> list[int]:
    """Each row's (or each of `rows`') argmax, the first of equal maxima. Float32 logits on
    the CPU go through numpy, whose argmax costs a fraction of torch's per call and over a
    batch's rows (same result: both take the first maximum, a NaN counting as one)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        values = logits.numpy()
        if rows:
            values = values[rows]
        tokens: list[int] = values.argmax(axis=1).tolist()
        return tokens
    if rows:
        logits = logits.index_select(0, upload_fields({"rows": rows}, {}, logits.device)["rows"])
    return list(download(logits.argmax(dim=-1)).tolist())


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's `top_k` best tokens and the smallest set reaching `top_p`."""
    device, vocab = logits.device, logits.shape[1]
    values, order = logits.sort(dim=-1, descending=True)  # (R, V)
    ranks = torch.arange(vocab, device=device)[None, :]
    values = values.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = torch.softmax(values, dim=-1)
    # Drop a token once the tokens ranked above it already reach top_p; the best stays.
    before = probs.cumsum(dim=-1) - probs
    values = values.masked_fill(before > top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, values)


def _pack(
    tokens: torch.Tensor, logprobs: torch.Tensor | None, rows: torch.Tensor | None, k: int
) -> torch.Tensor:
    """One int64 tensor of all the host needs: the tokens (S), then for the W rows of
    `logprobs` (W, V) the sampled token's log-probability (W) and the top k ids (W k) and
    log-probabilities (W k); float32 values travel as their bits."""
    if logprobs is None or rows is None:
        return tokens
    parts = [tokens, _bits(logprobs.gather(1, tokens[rows][:, None]))]
    if k:
        top = logprobs.topk(k, dim=-1)
        parts += [top.indices.flatten(), _bits(top.values)]
    return torch.cat(parts)


def _bits(values: torch.Tensor) -> torch.Tensor:
    return values.contiguous().flatten().view(torch.int32).to(torch.int64)


def _unpack(
    host: torch.Tensor, seqs: list[Sequence], plan: StepPlan
) -> tuple[list[int], list[Logprob | None]]:
    rows, k, s = len(plan.logprob_rows), plan.top_logprobs, len(seqs)
    token_ids: list[int] = host[:s].tolist()
    logprobs: list[Logprob | None] = [None] * s
    if not rows:
        return token_ids, logprobs
    parts = host[s:].split([rows, rows * k, rows * k])
    chosen = _floats(parts[0]).tolist()
    top_ids = parts[1].view(rows, k).tolist()
    top_values = _floats(parts[2]).view(rows, k).tolist()
    for r, i in enumerate(plan.logprob_rows):
        n = seqs[i].params.logprobs or 0
        pairs = tuple(zip(top_ids[r][:n], top_values[r][:n], strict=True))
        logprobs[i] = Logprob(token_ids[i], chosen[r], pairs)
    return token_ids, logprobs


def _floats(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)
