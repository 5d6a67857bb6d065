"""A step's rows as the host knows them: one pass over the sequences, no device work.

`StepPlan.build` sorts the rows by what they need (log-probabilities, bias and bans,
penalties, sampling and its cuts, seeds) and gathers the per-row parameters as flat lists;
`fields` names them for `transfer.upload_fields`, which sends them in one copy per dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.llm.sequence import Sequence


@dataclass
class StepPlan:
    """Which rows of a step need which work, and their parameters (flat, row order)."""

    num_rows: int
    # Every row greedy with nothing to apply to its logits but a grammar mask: one argmax.
    plain_greedy: bool = True
    # Rows that report log-probabilities, and the most alternatives any of them asks for.
    logprob_rows: list[int] = field(default_factory=list)
    top_logprobs: int = 0
    # logit_bias entries and min_tokens bans (bias -inf), as (row, token id, bias) columns.
    bias_rows: list[int] = field(default_factory=list)
    bias_ids: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)
    # Rows with repetition / presence / frequency penalties, and the three per row.
    penalised: list[int] = field(default_factory=list)
    repetition: list[float] = field(default_factory=list)
    frequency: list[float] = field(default_factory=list)
    presence: list[float] = field(default_factory=list)
    # Rows that sample (not greedy), and per sampled row its temperature and min_p.
    sampled: list[int] = field(default_factory=list)
    temperature: list[float] = field(default_factory=list)
    min_p: list[float] = field(default_factory=list)
    # Positions among the sampled rows cut by top-k or top-p, with their top_k and top_p.
    cut: list[int] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    # Positions among the sampled rows drawing from their own seed, and the others.
    seeded: list[int] = field(default_factory=list)
    unseeded: list[int] = field(default_factory=list)

    @classmethod
    def build(cls, seqs: list[Sequence], eos_token_ids: list[int], vocab: int) -> StepPlan:
        plan = cls(len(seqs))
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.logprobs is not None:
                plan.logprob_rows.append(i)
                plan.top_logprobs = max(plan.top_logprobs, p.logprobs)
            for token, bias in p.logit_bias.items():
                plan._bias(i, token, bias)
            if seq.num_output_tokens < p.min_tokens:
                for token in (*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)):
                    plan._bias(i, token, float("-inf"))
            if p.needs_penalties:
                plan.penalised.append(i)
                plan.repetition.append(p.repetition_penalty)
                plan.frequency.append(p.frequency_penalty)
                plan.presence.append(p.presence_penalty)
                plan.plain_greedy = False
            if p.greedy:
                continue
            plan.plain_greedy = False
            r = len(plan.sampled)
            plan.sampled.append(i)
            plan.temperature.append(p.temperature)
            plan.min_p.append(p.min_p)
            if p.top_k > 0 or p.top_p < 1.0:
                plan.cut.append(r)
                plan.top_k.append(p.top_k if p.top_k > 0 else vocab)
                plan.top_p.append(p.top_p)
            (plan.unseeded if p.seed is None else plan.seeded).append(r)
        return plan

    def _bias(self, row: int, token: int, bias: float) -> None:
        self.plain_greedy = False
        self.bias_rows.append(row)
        self.bias_ids.append(token)
        self.bias_values.append(bias)

    @property
    def any_min_p(self) -> bool:
        return any(m > 0.0 for m in self.min_p)

    def fields(self) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
        """The integer and the float lists the device needs, by name."""
        ints = {
            "logprob_rows": self.logprob_rows,
            "bias_rows": self.bias_rows,
            "bias_ids": self.bias_ids,
            "penalised": self.penalised,
            "sampled": self.sampled,
            "cut": self.cut,
            "top_k": self.top_k,
            "seeded": self.seeded,
            "unseeded": self.unseeded,
        }
        floats = {
            "bias_values": self.bias_values,
            "repetition": self.repetition,
            "frequency": self.frequency,
            "presence": self.presence,
            "temperature": self.temperature,
            "min_p": self.min_p,
            "top_p": self.top_p,
        }
        return ints, floats
