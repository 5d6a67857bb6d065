"""LoRA adapters through `LLMBackend`, as the hub drives it: an adapter loads on the resident
base without reloading or copying it, serves requests that name it (streaming, n > 1 with a
seed, a structured output) and shows in the slot metrics, survives an offload, refuses to
unload while it serves, and an adapter that does not fit or is not loaded is the caller's
error. int8 and int4 bases serve adapters too."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from backends.base import BackendContext
from backends.errors import InputError
from backends.llm.backend import LLMBackend
from backends.llm.lora import AdapterError
from backends.llm.lora.manager import AdapterInUseError
from backends.llm.sampling_params import SamplingParams
from backends.llm.structured import StructuredOutput
from backends.loading import module_bytes
from tests.backends.llm.lora_support import ALL_LINEAR, ATTENTION, build_adapter
from tests.backends.llm.support import build_model

PROMPT = [5, 9, 30, 41, 77, 12, 8]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-backend")
    llama = build_model(root, "llama")
    return {
        "base": llama,
        "attn": build_adapter(llama, root / "attn", ATTENTION, r=4, seed=1),
        "all": build_adapter(llama, root / "all", ALL_LINEAR, r=8, seed=2),
        "phi3": build_adapter(build_model(root, "phi3"), root / "phi3", ["qkv_proj"], seed=3),
        "rank16": build_adapter(llama, root / "rank16", ATTENTION, r=16, seed=4),
    }


async def collect(backend: LLMBackend, params: SamplingParams, adapter: str | None) -> list[str]:
    texts = [""] * params.n
    async for out in backend.generate(PROMPT, params, adapter=adapter):
        texts[out.index] += out.text
    return texts


def test_adapters_load_on_the_resident_base_and_serve(folders: dict[str, Path]) -> None:
    registry = CollectorRegistry()
    config = {"kv_cache_bytes": 2 * 2**20, "max_lora_rank": 8}
    backend = LLMBackend(BackendContext("tiny", "1", config, metrics_registry=registry))
    backend.load(folders["base"], "cpu", torch.float32)
    model = backend.engine.runner.model
    weights = {name: p.data_ptr() for name, p in model.named_parameters()}
    base_bytes = module_bytes(model)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    try:
        before = asyncio.run(collect(backend, greedy, None))
        nbytes = backend.load_adapter("support-bot@1", folders["attn"])
        backend.load_adapter("support-bot@2", folders["all"])
        assert backend.loaded_adapters() == {
            "support-bot@1": nbytes,
            "support-bot@2": backend.loaded_adapters()["support-bot@2"],
        }
        assert 0 < nbytes < base_bytes // 10
        # The base is neither reloaded nor copied: the same tensors, the same bytes.
        after = {re.sub(r"\.base_layer", "", n): p.data_ptr() for n, p in model.named_parameters()}
        assert after == weights and module_bytes(model) == base_bytes

        assert asyncio.run(collect(backend, greedy, None)) == before
        one = asyncio.run(collect(backend, greedy, "support-bot@1"))
        two = asyncio.run(collect(backend, greedy, "support-bot@2"))
        assert one != before and two != before and one != two
        labels = {"model": "tiny", "version": "1"}
        assert registry.get_sample_value("hub_llm_lora_slots_in_use", labels) == 2
        assert registry.get_sample_value("hub_llm_lora_slot_loads_total", labels) == 2

        # n > 1 with a seed: the same samples again; each sample its own.
        seeded = SamplingParams(temperature=1.0, n=2, seed=7, max_tokens=8)
        samples = asyncio.run(collect(backend, seeded, "support-bot@2"))
        assert asyncio.run(collect(backend, seeded, "support-bot@2")) == samples
        choice = SamplingParams(
            temperature=1.0, structured=StructuredOutput.choice(["yes", "no"]), max_tokens=8
        )
        asyncio.run(backend.compile_grammar(choice))
        assert asyncio.run(collect(backend, choice, "support-bot@1"))[0] in ("yes", "no")

        # Out of its device slot and back (host copy kept): it serves the same.
        backend.offload_adapter("support-bot@1")
        assert backend.engine.runner.lora.resident() == ["support-bot@2"]
        backend.restore_adapter("support-bot@1")
        assert backend.engine.runner.lora.resident() == ["support-bot@2", "support-bot@1"]
        assert asyncio.run(collect(backend, greedy, "support-bot@1")) == one
        # An offload of the base drops the device slots; after a restore the same again.
        backend.offload()
        backend.restore("cpu")
        assert asyncio.run(collect(backend, greedy, "support-bot@1")) == one

        with pytest.raises(InputError, match="adapter 'nope' is not loaded") as e:
            asyncio.run(collect(backend, greedy, "nope"))
        assert e.value.param == "model"
        with pytest.raises(AdapterError, match="another architecture"):
            backend.load_adapter("phi3", folders["phi3"])
        with pytest.raises(AdapterError, match="rank 16, above this model's max_lora_rank=8"):
            backend.load_adapter("big", folders["rank16"])
        assert asyncio.run(_unload_while_serving(backend)) == "refused"
        backend.unload_adapter("support-bot@1")  # once the aborted request has left
        assert list(backend.loaded_adapters()) == ["support-bot@2"]
        with pytest.raises(InputError, match="not loaded"):
            asyncio.run(collect(backend, greedy, "support-bot@1"))
    finally:
        backend.unload()


async def _unload_while_serving(backend: LLMBackend) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    async with backend.submit(PROMPT, params, adapter="support-bot@1") as stream:
        await anext(stream)
        try:
            backend.unload_adapter("support-bot@1", wait_s=0)
        except AdapterInUseError:
            return "refused"
    return "unloaded"


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_quantized_base_serves_adapters_beside_its_own_requests(
    folders: dict[str, Path], method: str
) -> None:
    config = {"kv_cache_bytes": 2 * 2**20, "quantization": method, "quantization_group_size": 32}
    backend = LLMBackend(BackendContext(f"tiny-{method}", "1", config))
    backend.load(folders["base"], "cpu", torch.float32)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    try:
        before = asyncio.run(collect(backend, greedy, None))
        backend.load_adapter("all", folders["all"])

        async def both() -> list[list[str]]:
            return list(
                await asyncio.gather(
                    collect(backend, greedy, None), collect(backend, greedy, "all")
                )
            )

        base, adapted = asyncio.run(both())
        assert base == before and adapted != before
    finally:
        backend.unload()
