"""Speculative decoding changes how many steps a sequence takes, never what it says: greedy
output with drafts equals greedy output without, token for token, for every architecture,
with chunked prefill, prefix hits, preemption, n=2, stop strings, a grammar and a LoRA
adapter; sampled output keeps the target's distribution (a chi-square test on a tiny
vocabulary); speculation turns itself down and a request may opt out.

Random weights rarely repeat what a prompt says, so the workloads make drafts land: prompts
that repeat themselves, and a few requests whose `logit_bias` confines them to three tokens
(the model still picks among them, so drafts are sometimes right and sometimes not).
"""

from __future__ import annotations

import random
import re
from dataclasses import replace
from pathlib import Path

import pytest

from backends.llm.engine import LLMEngine
from backends.llm.kv_cache_manager import KVCacheManager
from backends.llm.metrics import EngineMetrics
from backends.llm.sampling_params import SamplingParams
from backends.llm.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from backends.llm.sequence import Sequence
from backends.llm.speculative.ngram import propose_ngram
from backends.llm.structured import StructuredOutput
from backends.runtime_config import LLMConfig, RuntimeConfigError, SpeculativeConfig
from backends.tiny import TINY_LLM_ARCHITECTURES
from tests.backends.llm.fake_runner import FakeRunner, next_token
from tests.backends.llm.speculative_support import (
    BLOCK_SIZE,
    assert_same,
    engine,
    ngram,
    tokens_of,
    workload,
)
from tests.backends.llm.support import Completion, build_model, kv_bytes, run_all


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("speculative-models")


# ---- drafting -----------------------------------------------------------------------------
def test_prompt_lookup_copies_what_followed_the_latest_match() -> None:
    assert propose_ngram([1, 2, 3, 4, 1, 2], 3, 1, 3) == [3, 4, 1]
    assert propose_ngram([9, 1, 2, 7, 1, 2], 2, 2, 2) == [7, 1]  # latest match wins
    assert propose_ngram([1, 2, 3], 3, 1, 3) == []
    # A loop goes on past the end of the context (an overlapping copy).
    assert propose_ngram([5, 1, 2, 3, 1, 2], 7, 2, 2) == [3, 1, 2, 3, 1, 2, 3]
    assert propose_ngram([4, 4, 4], 4, 1, 1) == [4, 4, 4, 4]
    assert propose_ngram([1, 2, 3, 1, 5], 3, 2, 3) == []  # no match as long as min_match


def test_the_speculative_keys_are_checked_and_named() -> None:
    config = LLMConfig.parse({"speculative": {"method": "ngram", "num_tokens": 4}})
    assert config.speculative is not None and config.speculative.kind == "ngram"
    draft = LLMConfig.parse({"speculative": {"draft": "small@1", "num_tokens": 3}})
    assert draft.speculative is not None and draft.speculative.kind == "draft"
    bad = [
        ({}, "speculative.method"),
        ({"method": "ngram", "draft": "a@1"}, "speculative.draft"),
        ({"method": "ngram", "num_tokens": 0}, "speculative.num_tokens"),
        ({"method": "ngram", "min_match": 4, "max_match": 2}, "speculative.min_match"),
        ({"method": "ngram", "num_tokenz": 2}, "speculative.num_tokenz"),
    ]
    for raw, key in bad:
        with pytest.raises(RuntimeConfigError) as caught:
            LLMConfig.parse({"speculative": raw})
        assert caught.value.key == key


# ---- the scheduler and the KV cache alone (a fake runner) ---------------------------------
class DraftingFakeRunner(FakeRunner):
    """The fake runner, over drafts too: a draft position's KV is its draft prefix, and each
    position of a draft chunk samples the fake model's next token after that prefix."""

    def execute(self, output: SchedulerOutput) -> list[int]:
        self.outputs.append(output)
        sampled = []
        for item in output.scheduled:
            seq = item.seq
            context = seq.token_ids + list(item.drafts)
            for p in range(item.start, item.start + item.num_tokens):
                self.kv[self.slot(seq, p)] = tuple(context[: p + 1])
        for item in output.scheduled:
            seq, end = item.seq, item.start + item.num_tokens
            context = seq.token_ids + list(item.drafts)
            for p in range(end):  # every position reads the KV of its own prefix
                assert self.kv.get(self.slot(seq, p)) == tuple(context[: p + 1]), (seq, p)
            if item.sample:
                first = end - len(item.drafts)
                sampled += [next_token(context[:p]) for p in range(first, end + 1)]
        return sampled


def drafts_for(seq: Sequence, k: int, rng: random.Random) -> list[int]:
    """The fake model's own next tokens, with a wrong one from a random position on."""
    tokens = list(seq.token_ids)
    drafts = []
    wrong_at = rng.randint(0, k)
    for i in range(k):
        token = next_token(tokens) if i < wrong_at else 2
        drafts.append(token)
        tokens.append(token)
    return drafts


@pytest.mark.parametrize("seed", [0, 1])
def test_rejected_drafts_leave_no_trace_in_the_block_table_or_the_prefix_cache(
    seed: int,
) -> None:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 50) for _ in range(rng.randint(3, 20))] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)

    def scheduler(blocks: int) -> Scheduler:
        kv = KVCacheManager(blocks, BLOCK_SIZE, enable_prefix_caching=True)
        return Scheduler(SchedulerLimits(4, 16, 256, 100), kv, [])

    def run_all_fake(s: Scheduler, prompts: list[list[int]], k: int) -> list[list[int]]:
        seqs = [
            Sequence(i, str(i), p, params, max_tokens=17, block_size=BLOCK_SIZE)
            for i, p in enumerate(prompts)
        ]
        for seq in seqs:
            s.add(seq)
        runner = DraftingFakeRunner(BLOCK_SIZE)
        while s.num_unfinished:
            for seq in s.running:
                if k and seq.num_tokens - seq.num_computed_tokens == 1:
                    seq.draft_token_ids = drafts_for(seq, k, rng)
            output = s.schedule()
            s.update(output, runner.execute(output))
            for seq in s.running:  # blocks for the computed tokens only, until scheduled
                assert len(seq.block_ids) <= s.kv_cache.blocks_for(seq.num_computed_tokens + 1)
        assert s.kv_cache.pool.num_used_blocks == 0
        return [seq.output_token_ids for seq in seqs]

    expected = run_all_fake(scheduler(64), prompts, 0)
    # Drafts of 4, some rejected; 14 blocks make sequences preempt each other.
    spec = scheduler(14)
    assert run_all_fake(spec, prompts, 4) == expected
    assert spec.num_preemptions > 0
    # The cache now holds blocks the accepted drafts filled: prompts that continue into
    # those outputs hit them, and the fake runner checks every hit block holds that prefix.
    continued = [p + out[:12] for p, out in zip(prompts, expected, strict=True)]
    queries = spec.kv_cache.prefix_hits
    run_all_fake(spec, continued, 0)
    assert spec.kv_cache.prefix_hits > queries


# ---- greedy output is the target's ------------------------------------------------------
@pytest.mark.parametrize("arch", TINY_LLM_ARCHITECTURES)
def test_greedy_output_with_prompt_lookup_equals_without(arch: str, root: Path) -> None:
    folder = build_model(root, arch)
    requests = workload(max_tokens=16)
    base = run_all(engine(folder, None), requests)
    k = 2 + TINY_LLM_ARCHITECTURES.index(arch) % 7  # 2..8 over the architectures
    spec_engine = engine(folder, ngram(k, max_batch=64))
    spec = run_all(spec_engine, requests)
    assert_same(base, spec)
    stats = spec_engine.metrics.speculation
    assert stats.accepted > 0 and stats.accepted < stats.proposed  # both ways exercised
    assert spec_engine.kv_cache.prefix_hits > 0
    assert spec_engine.kv_cache.pool.num_used_blocks == 0


def test_the_fused_step_verifies_drafts_as_the_transformers_path_does(root: Path) -> None:
    folder = build_model(root, "llama")
    requests = workload(max_tokens=16)
    base = run_all(engine(folder, None, fused_step=False), requests)
    spec_engine = engine(folder, ngram(4, max_batch=64))
    runner = spec_engine.runner
    packed_with_drafts = []
    run_packed = runner._execute_packed

    def counting(output: SchedulerOutput) -> object:
        packed_with_drafts.extend(item for item in output.scheduled if item.drafts)
        return run_packed(output)

    runner._execute_packed = counting  # type: ignore[method-assign]
    assert_same(base, run_all(spec_engine, requests))
    assert spec_engine.metrics.speculation.accepted > 0
    assert runner.fused.steps > 0 and packed_with_drafts == []


def test_greedy_output_under_preemption_equals_without(root: Path) -> None:
    folder = build_model(root, "llama")
    requests = workload()
    base = run_all(engine(folder, None), requests)
    # 20 blocks of 4 tokens, far less than the load needs; the accelerators' decode path.
    small = {"kv_cache_bytes": kv_bytes(folder, 20, BLOCK_SIZE), "batched_decode": True}
    spec_engine = engine(folder, ngram(5, max_batch=64), fused_step=False, **small)
    assert_same(base, run_all(spec_engine, requests))
    assert spec_engine.scheduler.num_preemptions > 0
    assert spec_engine.metrics.speculation.accepted > 0
    assert spec_engine.kv_cache.pool.num_used_blocks == 0


def test_stop_strings_and_max_tokens_cut_accepted_drafts(root: Path) -> None:
    from transformers import AutoTokenizer

    folder = build_model(root, "llama")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    requests = workload(max_tokens=13)
    base = run_all(engine(folder, None, tokenizer), requests)
    # A stop string from the middle of each looping output.
    stopped = []
    for (prompt, params), samples in zip(requests, base, strict=True):
        text = samples[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        if params.logit_bias and stop.strip():
            stopped.append((prompt, replace(params, stop=(stop,))))
    assert stopped
    requests += stopped
    base = run_all(engine(folder, None, tokenizer), requests)
    spec_engine = engine(folder, ngram(8, max_batch=64), tokenizer)
    spec = run_all(spec_engine, requests)
    assert_same(base, spec)
    assert [c.text for s in spec for c in s] == [c.text for s in base for c in s]
    for (_, params), samples in zip(requests, spec, strict=True):
        for c in samples:
            assert len(c.token_ids) <= (params.max_tokens or 0)
            for stop in params.stop:
                assert stop not in c.text
    assert spec_engine.metrics.speculation.accepted > 0


def test_a_grammar_masks_every_draft(root: Path) -> None:
    from transformers import AutoTokenizer

    folder = build_model(root, "llama")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    pattern = "(ab|ba){4,12}"
    spec = StructuredOutput.regex(pattern)
    prompt = list(tokenizer.encode("ab ab ba ab ba ba ab"))
    requests = [(prompt, SamplingParams(temperature=0.0, max_tokens=40, structured=spec))] * 2
    base = run_all(engine(folder, None, tokenizer), requests)
    spec_engine = engine(folder, ngram(4, max_batch=64), tokenizer)
    out = run_all(spec_engine, requests)
    assert tokens_of(out) == tokens_of(base)
    for samples in out:
        assert re.fullmatch(pattern, samples[0].text)
    assert spec_engine.metrics.speculation.proposed > 0


def test_a_lora_adapter_speculates_with_its_own_weights(root: Path) -> None:
    from backends.llm.lora import read_adapter
    from tests.backends.llm.lora_support import ATTENTION, build_adapter

    folder = build_model(root, "llama")
    adapter = build_adapter(folder, root / "llama-lora", ATTENTION)
    requests = workload()
    owners: list[str | None] = ["a", None] * (len(requests) // 2)

    def run(spec: SpeculativeConfig | None) -> tuple[LLMEngine, list[list[Completion]]]:
        e = engine(folder, spec)
        e.runner.lora.add("a", read_adapter(adapter))
        return e, run_all(e, requests, owners)

    _, base = run(None)
    spec_engine, spec = run(ngram(4, max_batch=64))
    assert_same(base, spec)
    assert spec_engine.metrics.speculation.accepted > 0
    assert spec_engine.runner.lora.in_flight("a") == 0


# ---- turning itself down -----------------------------------------------------------------
def test_speculation_turns_itself_down_and_a_request_may_opt_out(root: Path) -> None:
    folder = build_model(root, "llama")
    requests = workload()
    # Opted out: nothing proposed.
    out = [(p, replace(s, speculative=False)) for p, s in requests]
    e = engine(folder, ngram(4, max_batch=64))
    run_all(e, out)
    assert e.metrics.speculation.proposed == 0
    # More decoding sequences than max_batch: the step is compute-bound, nothing proposed.
    e = engine(folder, ngram(4, max_batch=1))
    run_all(e, requests[:4])
    assert e.metrics.speculation.proposed == 0
    # Perfect acceptance demanded: every sequence stops after its first 8 proposed tokens
    # (a step proposes 4 at most).
    e = engine(folder, ngram(4, max_batch=64, min_acceptance=1.0, min_proposed=8))
    run_all(e, requests)
    assert 0 < e.metrics.speculation.proposed <= 11 * len(requests)


def test_speculation_metrics_are_exported() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "m", "1")
    metrics.speculation.observe(proposed=4, accepted=2, emitted=3)
    metrics.speculation.observe(proposed=2, accepted=0, emitted=1)
    text = generate_latest(registry).decode()
    assert 'hub_llm_spec_draft_tokens_total{model="m",version="1"} 6.0' in text
    assert 'hub_llm_spec_accepted_tokens_total{model="m",version="1"} 2.0' in text
    assert 'hub_llm_spec_accepted_by_position_total{model="m",position="2",version="1"} 1.0' in (
        text
    )
    summary = metrics.speculation.summary()
    # Position 1 judged twice (accepted once), 2 once (accepted), 3 once (rejected); the
    # fourth draft of the first step came after a rejection and was never judged.
    assert summary["acceptance_by_position"] == [0.5, 1.0, 0.0]
    assert summary["tokens_per_step"] == 2.0


def test_a_request_body_may_opt_out_of_speculation() -> None:
    from hub.api.openai_schemas import CompletionCreate

    body = CompletionCreate(model="m", prompt="x", speculative=False)
    assert body.sampling_params(max_tokens=4, logprobs=None).speculative is False
    default = CompletionCreate(model="m", prompt="x")
    assert default.sampling_params(max_tokens=4, logprobs=None).speculative is True
