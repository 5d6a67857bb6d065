"""The fused CPU step (backends/llm/fused): which models take it and why not, its check
against transformers at the start, its rebuild after an offload, the same logits on any
number of threads, bad indices refused before the kernel runs, and LoRA steps left to
transformers. Greedy equality with transformers for every family is test_correctness's."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.base import BackendContext
from backends.llm.backend import LLMBackend
from backends.llm.config import EngineConfig
from backends.llm.fused.decoder import LOGITS_ROWS, scratch_floats, unsupported_reason
from backends.llm.fused.kernel import CModel, fused_kernel
from backends.llm.fused.step import FusedStep
from backends.llm.kernel_settings import KernelSettings
from backends.llm.model_runner import ModelRunner
from backends.llm.sampling_params import SamplingParams
from tests.backends.llm.lora_support import ALL_LINEAR, build_adapter
from tests.backends.llm.support import build_model, make_engine, random_prompts, run_all

if fused_kernel(KernelSettings()) is None:
    pytest.skip("the fused kernel does not build here (no C compiler)", allow_module_level=True)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fused")


@pytest.fixture(scope="module")
def llama(root: Path) -> Path:
    return build_model(root, "llama")


def tokens_of(engine: Any, prompts: list[list[int]]) -> list[list[int]]:
    return [r[0].token_ids for r in run_all(engine, [(p, GREEDY) for p in prompts])]


def test_other_models_say_why_they_keep_the_transformers_path(root: Path, llama: Path) -> None:
    gemma = make_engine(build_model(root, "gemma2"))
    assert gemma.runner.fused.decoder is None
    assert "gemma2" in (unsupported_reason(gemma.runner.model) or "")
    int4 = ModelRunner.load(
        llama, "cpu", torch.float32, EngineConfig(), quantization="int4", group_size=32
    )
    assert int4.fused.decoder is None
    assert "int4" in (unsupported_reason(int4.model) or "")
    # Phi-3 runs fused (q/k/v and gate/up as rows of one layer each), not with a partial
    # rotary embedding (the kernel rotates whole heads).
    phi3 = build_model(root, "phi3")
    assert make_engine(phi3).runner.fused.decoder is not None
    partial = shutil.copytree(phi3, root / "phi3-partial-rotary")
    config = json.loads((partial / "config.json").read_text())
    config["rope_parameters"]["partial_rotary_factor"] = 0.5
    (partial / "config.json").write_text(json.dumps(config))
    engine = make_engine(partial)
    assert engine.runner.fused.decoder is None
    assert "partial rotary" in (unsupported_reason(engine.runner.model) or "")
    off = make_engine(llama, fused_step=False)
    assert off.runner.fused.decoder is None
    tokens_of(off, random_prompts(2, seed=1, lengths=(3, 12)))
    assert off.runner.fused.steps == 0


@pytest.mark.parametrize("arch", ["qwen2", "phi3"])
def test_int8_runs_fused_and_equals_its_weights_exact_float32_products(
    root: Path, arch: str
) -> None:
    """int8 layers stream a quarter of float32's bytes through the same step; the reference
    is transformers with each int8 layer as int8 times scale in float32 (`float32_reference`),
    not the bfloat16 kernels of the transformers path, so only near-ties may differ. Phi-3's
    q/k/v and gate/up are rows of one int8 layer each, with their rows' scales."""
    from transformers import AutoModelForCausalLM

    from backends.llm.quantization import float32_reference, quantize_model
    from tests.backends.llm.support import greedy_with_tops
    from tests.backends.llm.test_correctness import check_run

    folder = build_model(root, arch)  # qwen2's head is tied: the embeddings stay float32
    prompts = random_prompts(6, seed=5, lengths=(3, 40))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    quantize_model(model)
    with float32_reference():
        refs = greedy_with_tops(model, prompts, 8, 5)
    engine = make_engine(
        folder, quantization="int8", max_num_seqs=8, max_num_batched_tokens=32, block_size=4
    )
    assert engine.runner.fused.decoder is not None
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5)
    check_run(f"{arch} int8 fused", refs, run_all(engine, [(p, params) for p in prompts]))
    assert engine.runner.fused.steps > 0


def test_a_model_that_disagrees_with_the_check_keeps_the_transformers_path(
    llama: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A layer the kernel would misread (here: an input norm whose forward is not what its
    weights say) is caught by the comparison with transformers before any request."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm.forward
    monkeypatch.setattr(LlamaRMSNorm, "forward", lambda self, x: 1.5 * norm(self, x))
    with caplog.at_level(logging.INFO, logger="backends.llm.fused.start"):
        engine = make_engine(llama)
    assert engine.runner.fused.decoder is None
    assert "differ from transformers" in caplog.text
    tokens_of(engine, random_prompts(2, seed=2, lengths=(3, 12)))
    assert engine.runner.fused.steps == 0


async def test_offload_and_restore_rebuild_it_over_the_new_tensors(llama: Path) -> None:
    backend = LLMBackend(BackendContext("tiny", "1", {"kv_cache_bytes": 2**21}))
    backend.load(llama, "cpu", torch.float32)
    path = backend.engine.runner.fused
    prompt = backend.encode("The harbour town")

    async def text() -> str:
        return "".join([out.text async for out in backend.generate(prompt, GREEDY)])

    try:
        before, steps = await text(), path.steps
        assert steps > 0 and path.decoder is not None
        full = backend.memory_bytes()
        backend.offload()
        assert path.decoder is None  # it pointed at the parked weights and the old cache
        backend.restore("cpu")
        # Its scratch counts from the restore on, before the next step rebuilds it.
        assert path.scratch_bytes > 0 and 0 <= backend.memory_bytes() - full < 64 * 1024
        assert await text() == before
        assert path.steps > steps
        assert path.decoder is not None
        assert path.decoder.kv_caches is backend.engine.runner.kv_caches
    finally:
        await backend.aclose()
        backend.unload()


def _variant(root: Path, llama: Path, variant: str) -> Path:
    """The tiny Llama as given, without `max_position_embeddings` in its config.json (the
    model takes transformers' default), or saved as bfloat16."""
    if variant in ("plain", "int4 that fits no layer"):
        return llama
    folder = root / f"llama-{variant.replace(' ', '-')}"
    if not folder.exists():
        shutil.copytree(llama, folder)
        if variant == "no max_position_embeddings":
            config = json.loads((folder / "config.json").read_text())
            del config["max_position_embeddings"]
            (folder / "config.json").write_text(json.dumps(config))
        else:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16)
            model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "variant",
    ["plain", "no max_position_embeddings", "int4 that fits no layer", "bfloat16 checkpoint"],
)
def test_its_scratch_is_predicted_from_the_config_and_counted(
    root: Path, llama: Path, variant: str
) -> None:
    """The scratch grows with the rows of a step and the cores; the prediction from the
    folder equals what the decoder holds (none where the model cannot run fused: a bfloat16
    checkpoint loaded as it is), and the ledger counts it. int4 whose groups fit no layer
    leaves every layer int8, which runs fused."""
    folder = _variant(root, llama, variant)
    runtime: dict[str, Any] = {
        "kv_cache_bytes": 2**21, "max_num_batched_tokens": 256, "max_num_seqs": 64
    }  # fmt: skip
    if variant == "int4 that fits no layer":
        runtime |= {"quantization": "int4", "quantization_group_size": 256}
    backend = LLMBackend(BackendContext("tiny", "1", runtime))
    backend.load(folder, "cpu", None if variant == "bfloat16 checkpoint" else torch.float32)
    try:
        path = backend.engine.runner.fused
        scratch = path.scratch_bytes
        if variant == "bfloat16 checkpoint":
            assert path.decoder is None and scratch == 0
        else:
            assert path.decoder is not None
            assert scratch >= path.decoder._work.nbytes > 0
        predicted = LLMBackend.predict_memory(folder, runtime)
        without = LLMBackend.predict_memory(folder, {**runtime, "fused_step": False})
        assert predicted - without == scratch
        assert backend.memory_bytes() <= predicted
    finally:
        backend.unload()


@pytest.mark.parametrize(("rows", "context", "threads"), [(1, 1, 1), (17, 300, 2), (512, 4096, 16)])
def test_the_scratch_formula_is_the_kernel_s(rows: int, context: int, threads: int) -> None:
    kernel = fused_kernel(KernelSettings())
    assert kernel is not None
    shape = {"hidden": 96, "heads": 6, "kv_heads": 2, "head_dim": 16, "inter": 200}
    model = CModel(**shape, max_context=context, threads=threads)
    assert kernel.work_floats(model, rows) == scratch_floats(
        **shape, max_context=context, rows=rows, threads=threads
    )


def test_contexts_longer_than_an_attention_chunk_equal_transformers(llama: Path) -> None:
    """Decodes past 512 tokens of context take attention in chunks (csrc/attend.h)."""
    from tests.backends.llm.test_correctness import MAX_TOKENS, check_run, hf_reference

    prompts = random_prompts(2, seed=9, lengths=(520, 800))
    refs = hf_reference(llama, prompts)
    engine = make_engine(llama, kv_cache_bytes=2**22, max_num_seqs=2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    check_run("llama long contexts", refs, run_all(engine, [(p, params) for p in prompts]))
    assert engine.runner.fused.steps > 0


def test_the_thread_count_does_not_change_the_logits(llama: Path) -> None:
    """Every output of a stage is one thread's work from start to end, so the sums run in the
    same order however many threads share the stage."""
    decoder = make_engine(llama).runner.fused.decoder
    assert decoder is not None
    kernel = fused_kernel(KernelSettings())
    if decoder.threads < 2 or kernel is None or not kernel.threaded:
        pytest.skip("one core, or a kernel built without OpenMP: nothing to compare")
    n = 11
    step = FusedStep(
        [(13 * i + 7) % 500 for i in range(n)],
        list(range(n)),
        list(range(n)),
        list(range(-(-n // 16))),
        [0] * n,
        list(range(1, n + 1)),
        list(range(n)),
    )
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decoder(step)
        torch.set_num_threads(2)
        two = decoder(step)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_weights_larger_than_the_cache_are_read_ahead_without_changing_a_logit(
    llama: Path, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose weights outgrow the last-level cache reads them ahead non-temporally
    (they would not be cached at the next step anyway); a model that fits keeps the ordinary
    read-ahead. Only where the weights' bytes stay differs, not a logit."""
    import backends.llm.fused.decoder as fused_decoder

    fits = make_engine(llama).runner.fused.decoder
    assert fits is not None and fits.weight_bytes > 0
    cache = fused_decoder.last_level_cache_bytes()
    assert fits._model.stream_weights == (cache is not None and fits.weight_bytes > cache)
    monkeypatch.setattr(fused_decoder, "last_level_cache_bytes", lambda: fits.weight_bytes - 1)
    streams = make_engine(llama).runner.fused.decoder
    assert streams is not None and streams._model.stream_weights == 1
    monkeypatch.setattr(fused_decoder, "last_level_cache_bytes", lambda: fits.weight_bytes)
    cached = make_engine(llama).runner.fused.decoder
    assert cached is not None and cached._model.stream_weights == 0

    tokens = [(37 * i + 11) % 500 for i in range(rows)]
    every = list(range(rows))
    step = FusedStep(tokens, every, every, [0], [0] * rows, [i + 1 for i in every], every)
    assert torch.equal(streams(step), cached(step))


@pytest.mark.parametrize("intermediate", [1408, 3000])
@pytest.mark.parametrize("rows", [2, 3, 5])
def test_a_few_rows_of_a_wide_projection_equal_transformers(
    root: Path, rows: int, intermediate: int
) -> None:
    """A step of 2-5 rows (a verify step of speculative decoding) takes the multi-row tiles;
    the down projection's inputs (`intermediate` floats a row) are one group of rows in L1
    or, wider, several: every row's logits equal transformers' at its position."""
    from transformers import AutoModelForCausalLM

    from backends.tiny import build_tiny_llm

    folder = root / f"wide-{intermediate}"
    if not (folder / "config.json").is_file():
        build_tiny_llm(folder, "llama", config_overrides={"intermediate_size": intermediate})
    decoder = make_engine(folder).runner.fused.decoder
    assert decoder is not None
    tokens = [(37 * i + 11) % 500 for i in range(rows)]
    every = list(range(rows))
    step = FusedStep(tokens, every, every, [0], [0] * rows, [i + 1 for i in every], every)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.inference_mode():
        expected = model(input_ids=torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(decoder(step), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("intermediate", [1408, 3000])
@pytest.mark.parametrize("rows", [6, 24, 29, 40])
def test_a_prompt_chunk_s_panels_equal_transformers(
    root: Path, rows: int, intermediate: int
) -> None:
    """A chunk of six rows or more takes the panel tiles: a narrow panel alone (6), a full
    panel and a narrow one (24, 40), full panels the last padded (29), against weight rows in
    whole tiles and a part tile (1,408 and 3,000 are not both multiples of a tile's width):
    every row's logits equal transformers' at its position."""
    from transformers import AutoModelForCausalLM

    from backends.tiny import build_tiny_llm

    folder = root / f"wide-{intermediate}"
    if not (folder / "config.json").is_file():
        build_tiny_llm(folder, "llama", config_overrides={"intermediate_size": intermediate})
    runner = make_engine(folder).runner
    decoder = runner.fused.decoder
    assert decoder is not None
    tokens = [(37 * i + 11) % 500 for i in range(rows)]
    every = list(range(rows))
    blocks = list(range(-(-rows // runner.block_size)))
    step = FusedStep(tokens, every, every, blocks, [0] * rows, [i + 1 for i in every], every)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.inference_mode():
        expected = model(input_ids=torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(decoder(step), expected, rtol=1e-4, atol=1e-4)


# Two sequences in block 0: one decoding its first token, one its second (sampled).
GOOD_STEP: dict[str, list[int]] = {
    "tokens": [10, 11],
    "positions": [0, 1],
    "slots": [0, 1],
    "tables": [0],
    "table_starts": [0, 0],
    "lens": [1, 2],
    "sample_rows": [1],
}


def test_bad_indices_are_refused_before_the_kernel_runs(llama: Path) -> None:
    decoder = make_engine(llama).runner.fused.decoder
    assert decoder is not None

    def step(**change: Any) -> FusedStep:
        return FusedStep(**(GOOD_STEP | change))

    decoder.check(step())
    for change, message in [
        ({"tokens": [10, decoder.vocab]}, "token ids"),
        ({"slots": [0, decoder.slots]}, "cache slots"),
        ({"lens": [1, 10**9], "positions": [0, 10**9 - 1]}, "contexts"),
        ({"sample_rows": [2]}, "sample row"),
        ({"sample_rows": [1, 1]}, "at most once"),
        ({"positions": [0, 5]}, "position"),
        ({"slots": [0]}, "per row"),
        ({"tables": [10**9]}, "block ids"),
        ({"table_starts": [0, 1]}, "needs more blocks"),
    ]:
        with pytest.raises(ValueError, match=message):
            decoder(step(**change))


def test_lora_steps_run_through_transformers_and_base_steps_fused(root: Path) -> None:
    base = build_model(root, "qwen2")
    adapter = build_adapter(base, root / "qwen2-all", ALL_LINEAR, r=4, seed=3)
    from backends.llm.lora import read_adapter

    prompts = random_prompts(3, seed=4, lengths=(3, 20))
    plain = tokens_of(make_engine(base, fused_step=False), prompts)
    engine = make_engine(base)
    engine.runner.lora.add("a", read_adapter(adapter))
    assert tokens_of(engine, prompts) == plain  # the base, fused beside a loaded adapter
    fused = engine.runner.fused.steps
    assert fused > 0
    adapted = run_all(engine, [(p, GREEDY) for p in prompts], ["a"] * len(prompts))
    assert [r[0].token_ids for r in adapted] != plain
    assert engine.runner.fused.steps == fused  # no step with the adapter ran fused


@pytest.mark.parametrize("rows", [1, 5, LOGITS_ROWS + 3])
def test_greedy_tokens_are_the_argmax_of_the_logits(llama: Path, rows: int) -> None:
    """`greedy` (the logits in the decoder's own buffer, or a tensor past its rows) picks
    what the logits' argmax picks, one chunk at positions 0.. sampled at every row."""
    runner = make_engine(llama, max_num_batched_tokens=64).runner
    decoder = runner.fused.decoder
    assert decoder is not None

    def step() -> FusedStep:
        every = list(range(rows))
        tokens = [(7919 * i + 11) % decoder.vocab for i in every]
        blocks = list(range(-(-rows // runner.block_size)))
        return FusedStep(tokens, every, every, blocks, [0] * rows, [i + 1 for i in every], every)

    expected = decoder(step()).argmax(dim=-1).tolist()
    assert decoder.greedy(step()) == expected and len(expected) == rows


def test_the_kernel_itself_refuses_indices_out_of_range(llama: Path) -> None:
    """Past `check` (`checked=True` skips it), the C step checks every index it follows and
    refuses the step: nothing runs, the KV cache is left as it was."""
    decoder = make_engine(llama).runner.fused.decoder
    assert decoder is not None
    good = GOOD_STEP  # the C step takes it; the cases below each break one index
    rows = 4 * decoder.max_rows  # past the scratch however few threads run the step
    too_many = {"tokens": [10] * rows, "positions": [0] * rows, "slots": [0] * rows,
                "table_starts": [0] * rows, "lens": [1] * rows, "sample_rows": [0]}  # fmt: skip
    before = [kv.clone() for kv in decoder.kv_caches]
    for change, message in [
        ({"tables": [decoder.slots]}, "block id is outside the KV cache"),
        ({"tables": [-1]}, "block id is outside the KV cache"),
        ({"table_starts": [0, 1]}, "outside its block table"),
        ({"tables": [], "table_starts": [0, 0]}, "outside its block table"),
        ({"lens": [1, 0]}, "context length"),
        ({"lens": [1, 10**9]}, "context length"),
        ({"positions": [0, 10**9]}, "position is outside the rotary tables"),
        ({"tokens": [10, decoder.vocab]}, "token id"),
        ({"slots": [0, -1]}, "cache slot"),
        ({"sample_rows": [2]}, "sample row"),
        (too_many, "more scratch"),
    ]:
        with pytest.raises(ValueError, match=f"fused step: .*refused the call: .*{message}"):
            decoder(FusedStep(**(good | change)), checked=True)
    assert all(torch.equal(a, b) for a, b in zip(before, decoder.kv_caches, strict=True))
    assert decoder(FusedStep(**good), checked=True).shape == (1, decoder.vocab)
