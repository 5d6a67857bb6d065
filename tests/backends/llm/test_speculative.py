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
from typing import Any

import pytest
import torch

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
from tests.backends.llm.support import (
    Completion,
    build_model,
    kv_bytes,
    make_engine,
    random_prompts,
    run_all,
)

BLOCK_SIZE = 4
STEP_BUDGET = 32
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("speculative-models")


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


def engine(folder: Path, spec: SpeculativeConfig | None, tokenizer: Any = None, **config: Any):
    options = {"block_size": BLOCK_SIZE, "max_num_seqs": 8, "max_num_batched_tokens": STEP_BUDGET}
    return make_engine(folder, tokenizer, speculative=spec, **(options | config))


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
    assert summary["acceptance_by_position"] == [0.5, 0.5, 0.0, 0.0]
    assert summary["tokens_per_step"] == 2.0


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


# ---- a draft model -------------------------------------------------------------------------
def draft_engine(folder: Path, draft_folder: Path, k: int, **config: Any) -> LLMEngine:
    from backends.llm.config import EngineConfig
    from backends.llm.model_runner import ModelRunner
    from backends.llm.speculative.draft_model import DraftModel

    options = {"block_size": BLOCK_SIZE, "max_num_seqs": 8, "max_num_batched_tokens": STEP_BUDGET}
    spec = SpeculativeConfig(draft="draft@1", num_tokens=k, max_batch=64)
    engine_config = EngineConfig(speculative=spec, **(options | config))
    runner = ModelRunner.load(folder, "cpu", torch.float32, engine_config)
    draft_config = EngineConfig(**(options | config))
    draft_runner = ModelRunner.load(draft_folder, "cpu", torch.float32, draft_config)
    draft = DraftModel(draft_runner, BLOCK_SIZE, STEP_BUDGET)
    draft.check_vocab(runner.vocab_size)
    return LLMEngine(engine_config, runner, proposer=draft)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_output_with_a_draft_model_equals_without(arch: str, root: Path) -> None:
    from backends.tiny import build_tiny_llm

    folder = build_model(root, arch)
    other = root / f"{arch}-draft"
    if not (other / "config.json").is_file():
        build_tiny_llm(other, arch, num_layers=1, seed=5)
    requests = workload()
    base = run_all(engine(folder, None), requests)
    # The target as its own draft: nearly every draft is accepted.
    same = draft_engine(folder, folder, 4)
    assert_same(base, run_all(same, requests))
    assert same.metrics.speculation.acceptance_rate > 0.9
    assert same.metrics.speculation.tokens_per_step > 3
    # Another model: drafts mostly rejected, rolled back in both caches, output unchanged.
    # Preemption too (20 blocks of 4 tokens).
    small = {"kv_cache_bytes": kv_bytes(folder, 20, BLOCK_SIZE)}
    different = draft_engine(folder, other, 3, **small)
    assert_same(base, run_all(different, requests))
    assert different.metrics.speculation.proposed > 0
    assert different.scheduler.num_preemptions > 0
    assert different.kv_cache.pool.num_used_blocks == 0


def test_a_draft_with_another_tokenizer_is_refused_by_name(root: Path) -> None:
    from transformers import AutoTokenizer

    from backends.errors import InputError
    from backends.llm.speculative.compat import check_same_tokenizer
    from backends.tiny import build_tiny_llm

    folder = build_model(root, "llama")
    other = root / "llama-other-vocab"
    if not (other / "config.json").is_file():
        build_tiny_llm(other, "llama", vocab_size=384)
    target = AutoTokenizer.from_pretrained(folder)
    check_same_tokenizer(target, AutoTokenizer.from_pretrained(folder))
    with pytest.raises(InputError, match="vocabulary of 384 tokens and the target 512"):
        check_same_tokenizer(target, AutoTokenizer.from_pretrained(other), "small@1")


async def test_the_backend_loads_moves_and_frees_the_draft_with_its_target(root: Path) -> None:
    from backends.base import BackendContext
    from backends.errors import LoadError
    from backends.llm.backend import LLMBackend
    from backends.llm.context import LLMContext
    from backends.llm.kernel_settings import KernelSettings
    from backends.loading import module_bytes
    from backends.tiny import build_tiny_llm

    folder = build_model(root, "llama")
    other_vocab = root / "llama-other-vocab"
    if not (other_vocab / "config.json").is_file():
        build_tiny_llm(other_vocab, "llama", vocab_size=384)
    config = {"kv_cache_bytes": 2**20, "speculative": {"draft": "self@1", "num_tokens": 3}}

    def backend(draft_dir: Path | None) -> LLMBackend:
        context = BackendContext("t", "1", config)
        return LLMBackend(LLMContext.of(context, KernelSettings(), draft_dir=draft_dir))

    with pytest.raises(LoadError, match="not resolved"):
        backend(None).load(folder, "cpu", torch.float32)
    with pytest.raises(LoadError, match="vocabulary of 384 tokens"):
        backend(other_vocab).load(folder, "cpu", torch.float32)

    b = backend(folder)  # the target as its own draft
    b.load(folder, "cpu", torch.float32)
    weights = module_bytes(b.engine.runner.model)
    full = b.memory_bytes()
    assert full >= 2 * weights + 2 * 2**20  # both models and both caches are charged
    assert b.offload_bytes() == 2 * weights
    prompt = b.encode("the harbour the harbour the harbour")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def tokens() -> list[int]:
        return [t async for out in b.generate(prompt, params) for t in out.token_ids]

    before = await tokens()
    b.offload()
    assert b.memory_bytes() == 0
    b.restore("cpu")
    assert await tokens() == before
    stats = b.engine.metrics.speculation
    assert stats.acceptance_rate > 0.9
    await b.aclose()
    b.unload()
    assert b.memory_bytes() == 0


def test_a_request_body_may_opt_out_of_speculation() -> None:
    from hub.api.openai_schemas import CompletionCreate

    body = CompletionCreate(model="m", prompt="x", speculative=False)
    assert body.sampling_params(max_tokens=4, logprobs=None).speculative is False
    default = CompletionCreate(model="m", prompt="x")
    assert default.sampling_params(max_tokens=4, logprobs=None).speculative is True
