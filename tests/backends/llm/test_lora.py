"""LoRA adapters in the engine: greedy output of the base and of two adapters, requested at
once so that steps mix all three, equals transformers + PEFT's for each, token for token (a
divergence only at a numeric near-tie, the rule of test_correctness), with chunked prefill,
prefix hits and preemption; the prefix cache never shares blocks between adapters; more adapters in
use than device slots take turns and still answer correctly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backends.llm.engine import LLMEngine
from backends.llm.sampling_params import SamplingParams
from tests.backends.llm.lora_support import ALL_LINEAR, ATTENTION, build_adapter, peft_greedy
from tests.backends.llm.support import build_model, kv_bytes, make_engine, random_prompts, run_all
from tests.backends.llm.test_correctness import compare

MAX_TOKENS = 12
BLOCK_SIZE = 4
STEP_BUDGET = 32


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora")


def adapters_for(root: Path, arch: str) -> tuple[Path, dict[str, Path]]:
    """The base of `arch` and two adapters: attention projections only (rank 4), and every
    linear layer (rank 8, rsLoRA scaling)."""
    base = build_model(root, arch)
    return base, {
        "attn": build_adapter(base, root / f"{arch}-attn", ATTENTION, r=4, alpha=16, seed=1),
        "all": build_adapter(
            base, root / f"{arch}-all", ALL_LINEAR, r=8, alpha=16, seed=2, use_rslora=True
        ),
    }


def prompts() -> list[list[int]]:
    """Eight prompts of 3 to 48 tokens (some longer than a step's budget: chunked), four of
    them sharing a 16-token prefix (prefix hits within each adapter)."""
    shared = random_prompts(1, seed=200, lengths=(16, 16))[0]
    return [shared + p for p in random_prompts(4, seed=201, lengths=(1, 24))] + random_prompts(
        4, seed=202, lengths=(3, 48)
    )


def record_steps(engine: LLMEngine) -> list[set[str | None]]:
    """The adapters of every step the engine runs from now on (None: the base)."""
    steps: list[set[str | None]] = []
    lora = engine.runner.lora
    begin = lora.begin_step

    def recording(segments: Any) -> None:
        steps.append({key for key, _ in segments})
        begin(segments)

    lora.begin_step = recording  # type: ignore[method-assign]
    return steps


def check(label: str, refs: list[Any], outputs: list[Any]) -> int:
    verdicts = [compare(ref, out[0]) for ref, out in zip(refs, outputs, strict=True)]
    failures = [v for v in verdicts if v not in ("exact", "near-tie")]
    assert not failures, f"{label}: {failures}"
    print(f"{label}: {verdicts.count('exact')}/{len(verdicts)} exact")
    return verdicts.count("exact")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_base_and_two_adapters_in_one_batch_equal_peft(arch: str, root: Path) -> None:
    base, adapters = adapters_for(root, arch)
    ps = prompts()
    refs = {None: peft_greedy(base, None, ps, MAX_TOKENS)}
    refs |= {key: peft_greedy(base, folder, ps, MAX_TOKENS) for key, folder in adapters.items()}
    # The adapters really change the output (else the test would prove nothing).
    for key in adapters:
        assert sum(a[0] != b[0] for a, b in zip(refs[key], refs[None], strict=True)) >= 6

    engine = make_engine(
        base, block_size=BLOCK_SIZE, max_num_seqs=16, max_num_batched_tokens=STEP_BUDGET
    )
    for key, folder in adapters.items():
        engine.runner.lora.add(key, _spec(folder))
    steps = record_steps(engine)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)
    keys: list[str | None] = [None, "attn", "all"]
    requests = [(p, params) for _ in keys for p in ps]
    owners = [key for key in keys for _ in ps]
    results = run_all(engine, requests, owners)

    exact = 0
    for i, key in enumerate(keys):
        exact += check(f"{arch} {key}", refs[key], results[i * len(ps) : (i + 1) * len(ps)])
    assert exact >= len(requests) * 2 // 3, "near-ties should be the exception"
    assert any(s == {None, "attn", "all"} for s in steps), "no step mixed all three"
    assert engine.kv_cache.prefix_hits > 0
    assert engine.runner.lora.in_flight("attn") == 0

    # Preemption (a KV cache of 24 blocks, far less than the load needs), on the decode
    # attention path of accelerators.
    engine = make_engine(
        base,
        batched_decode=True,
        block_size=BLOCK_SIZE,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        kv_cache_bytes=kv_bytes(base, 24, BLOCK_SIZE),
    )
    for key, folder in adapters.items():
        engine.runner.lora.add(key, _spec(folder))
    results = run_all(engine, requests, owners)
    for i, key in enumerate(keys):
        check(f"{arch} {key} preempted", refs[key], results[i * len(ps) : (i + 1) * len(ps)])
    assert engine.scheduler.num_preemptions > 0


def _spec(folder: Path) -> Any:
    from backends.llm.lora import read_adapter

    return read_adapter(folder)


def test_the_same_prompt_on_two_adapters_shares_no_blocks(root: Path) -> None:
    base, adapters = adapters_for(root, "llama")
    engine = make_engine(base, block_size=BLOCK_SIZE, max_num_seqs=4, max_num_batched_tokens=64)
    for key, folder in adapters.items():
        engine.runner.lora.add(key, _spec(folder))
    prompt = random_prompts(1, seed=300, lengths=(24, 24))[0]
    params = SamplingParams(temperature=0.0, max_tokens=2)

    def cached(adapter: str | None) -> int:
        return run_all(engine, [(prompt, params)], [adapter])[0][0].num_cached_tokens

    assert cached("attn") == 0
    assert cached("attn") == 20  # its own blocks again: every full block before the last token
    assert cached("all") == 0
    assert cached(None) == 0
    assert cached("all") == 20
    # A reload of a key is another adapter: its blocks start afresh.
    engine.runner.lora.add("attn", _spec(adapters["all"]))
    assert cached("attn") == 0


def test_more_adapters_than_slots_take_turns_and_answer_correctly(root: Path) -> None:
    base, adapters = adapters_for(root, "llama")
    adapters["attn2"] = build_adapter(base, root / "llama-attn2", ATTENTION, r=2, seed=3)
    ps = prompts()[:4]
    keys: list[str | None] = [None, *adapters]
    refs = {key: peft_greedy(base, adapters[key] if key else None, ps, MAX_TOKENS) for key in keys}
    # Two slots for three adapters, each with requests in flight at once.
    engine = make_engine(
        base, block_size=BLOCK_SIZE, max_num_seqs=16, max_num_batched_tokens=64, max_loras=2
    )
    for key, folder in adapters.items():
        engine.runner.lora.add(key, _spec(folder))
    steps = record_steps(engine)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)
    results = run_all(
        engine, [(p, params) for _ in keys for p in ps], [key for key in keys for _ in ps]
    )
    for i, key in enumerate(keys):
        check(f"2 slots, {key}", refs[key], results[i * len(ps) : (i + 1) * len(ps)])
    assert max(len(s - {None}) for s in steps) == 2
    assert engine.runner.lora.slot_loads >= 3
    assert len(engine.runner.lora.resident()) <= 2
