"""Helpers for the speculative decoding tests: a workload whose drafts land, engines with
and without speculation, and the comparison of their outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backends.llm.engine import LLMEngine
from backends.llm.sampling_params import SamplingParams
from backends.llm.speculative.cost import SpeculationCost
from backends.runtime_config import SpeculativeConfig
from tests.backends.llm.support import Completion, make_engine, random_prompts

BLOCK_SIZE = 4
STEP_BUDGET = 32
MAX_TOKENS = 24


def ngram(k: int, **options: Any) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_tokens=k, **options)


def workload(max_tokens: int = MAX_TOKENS) -> list[tuple[list[int], SamplingParams]]:
    """Eight requests: prompts that repeat themselves (two share a 20-token prefix, one is
    longer than a step's budget), one n=2, two confined to three tokens by logit_bias."""
    shared = random_prompts(1, seed=300, lengths=(20, 20))[0]
    prompts = [shared + p for p in random_prompts(2, seed=301, lengths=(4, 12))]
    prompts += random_prompts(4, seed=302, lengths=(6, 30))
    prompts = [p + p[-12:] + p[-12:] for p in prompts]  # copies to look up
    assert max(len(p) for p in prompts) > STEP_BUDGET
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2) for _ in prompts]
    params[1] = SamplingParams(temperature=0.0, max_tokens=max_tokens, n=2)
    confined = {40: 5.0, 41: 5.0, 42: 5.0}
    for prompt in random_prompts(2, seed=303, lengths=(5, 9)):
        prompts.append(prompt)
        params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, logit_bias=confined))
    return list(zip(prompts, params, strict=True))


def tokens_of(results: list[list[Completion]]) -> list[list[int]]:
    return [c.token_ids for samples in results for c in samples]


def assert_same(base: list[list[Completion]], spec: list[list[Completion]]) -> None:
    assert tokens_of(spec) == tokens_of(base)
    for b, s in zip(base, spec, strict=True):
        for x, y in zip(b, s, strict=True):
            assert x.finish_reason == y.finish_reason
            assert [lp.token_id for lp in x.logprobs] == [lp.token_id for lp in y.logprobs]
            assert [[t for t, _ in lp.top] for lp in x.logprobs] == [
                [t for t, _ in lp.top] for lp in y.logprobs
            ]


def engine(
    folder: Path, spec: SpeculativeConfig | None, tokenizer: Any = None, **config: Any
) -> LLMEngine:
    """A CPU engine with small blocks and a 32-token step budget; `spec` None: no speculation.
    Every step speculates whatever it costs (`speculative.cost` has tests of its own)."""
    options = {"block_size": BLOCK_SIZE, "max_num_seqs": 8, "max_num_batched_tokens": STEP_BUDGET}
    e = make_engine(folder, tokenizer, speculative=spec, **(options | config))
    return speculating_always(e)


def speculating_always(e: LLMEngine) -> LLMEngine:
    """`e`, its speculation no longer turned down by its cost."""
    if e.speculator is not None:
        e.speculator.cost = SpeculationCost(by_cost=False)
    return e
