"""The sections of `benchmarks/gpu_check.py`: each takes a `Context`, records its figures as it
goes and raises nothing it could record instead (`Context.part`).

Sizes: on a GPU the LLM is a random bfloat16 Llama of TinyLlama-1.1B's shape and the workload
is the issue's (64 requests, 64-512-token prompts, 128 new tokens, EOS ignored); with
`--small` every shape and count shrinks so a CPU runs every section in minutes.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

MiB = 2**20


@dataclass
class Context:
    """One section's run: where it writes, on what, at which sizes, until when."""

    out: Path
    device: str
    small: bool
    engine_config: dict[str, Any]
    deadline: float
    section: str
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.started = time.time()
        self.data.update({"status": "running", "device": self.device, "small": self.small})
        self.flush()

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def work(self) -> Path:
        """Models built once per run, shared by the sections."""
        path = self.out / "work"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def left(self) -> float:
        return self.deadline - time.time()

    def set(self, key: str, value: Any) -> Any:
        self.data[key] = value
        self.flush()
        return value

    def error(self, where: str, e: BaseException) -> None:
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        self.data.setdefault("errors", {})[where] = text[-2000:]
        print(f"[{self.section}] {where} failed: {type(e).__name__}: {e}", flush=True)
        self.flush()

    @contextlib.contextmanager
    def part(self, name: str, min_left: float = 0.0) -> Iterator[bool]:
        """One measurement: its failure is recorded and the section goes on; skipped (and
        said so) when fewer than `min_left` seconds remain."""
        if self.left() < min_left:
            self.data.setdefault("skipped", []).append(f"{name} ({self.left():.0f}s left)")
            self.flush()
            yield False
            return
        start = time.time()
        print(f"[{self.section}] {name}", flush=True)
        try:
            yield True
        except Exception as e:
            self.error(name, e)
        finally:
            self.data.setdefault("part_seconds", {})[name] = round(time.time() - start, 2)
            self.flush()

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def finish(self) -> None:
        self.data["status"] = "done_with_errors" if self.data.get("errors") else "done"
        self.data["seconds"] = round(time.time() - self.started, 1)
        self.flush()

    def flush(self) -> None:
        path = self.out / "sections" / f"{self.section}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=repr) + "\n")
        os.replace(tmp, path)


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def ms(seconds: float | None) -> float | None:
    return round(1000 * seconds, 3) if seconds is not None else None


# ---- environment ------------------------------------------------------------------------
def environment(ctx: Context) -> None:
    """Versions, the device, NVML's view of it and what the CUDA context takes."""
    import platform

    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "sentence_transformers", "tokenizers", "safetensors"):
        try:
            versions[name] = __import__(name).__version__
        except Exception as e:
            versions[name] = f"missing: {e}"
    ctx.set("versions", versions)
    ctx.set("cuda_available", torch.cuda.is_available())
    with ctx.part("device"):
        if ctx.cuda:
            index = torch.device(ctx.device).index or 0
            props = torch.cuda.get_device_properties(index)
            free0, total = torch.cuda.mem_get_info(index)
            torch.zeros(1, device=ctx.device)
            ctx.sync()
            free1, _ = torch.cuda.mem_get_info(index)
            ctx.set("gpu", {"name": props.name, "capability": f"{props.major}.{props.minor}",
                            "total_bytes": total, "cuda": torch.version.cuda,
                            # The context this process made, beside the allocator's blocks
                            # (other processes' use moves this too: read it on an idle GPU).
                            "context_bytes_estimate": free0 - free1
                            - torch.cuda.memory_reserved(index)})  # fmt: skip
        else:
            ctx.set("cpu", {"cores": os.cpu_count(), "threads": torch.get_num_threads()})
    with ctx.part("probe"):
        from hub.dependencies.devices import probe_device

        start = time.perf_counter()
        probe_device(ctx.device)
        ctx.set("probe_ms", ms(time.perf_counter() - start))
    with ctx.part("nvml"):
        from hub.dependencies.gpu_metrics import open_nvml

        reader = open_nvml()
        ctx.set("nvml", reader.read(ctx.device).report() if reader and ctx.cuda else None)
    with ctx.part("copy_bandwidth"):
        nbytes = (16 if ctx.small else 1024) * MiB
        src = torch.ones(nbytes, dtype=torch.uint8, device=ctx.device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        ctx.sync()
        start = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        ctx.sync()
        ctx.set("d2d_gbs", round(2 * 5 * nbytes / (time.perf_counter() - start) / 1e9, 1))


# ---- correctness ------------------------------------------------------------------------
def engine_variants(ctx: Context) -> list[tuple[str, dict[str, Any]]]:
    """The engine configs to check: as given, and with CUDA graphs once the engine has them
    (a key `cuda_graphs` of EngineConfig) and they were not set either way."""
    import dataclasses

    from backends.llm.config import EngineConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    out = [("as_configured", dict(ctx.engine_config))]
    if "cuda_graphs" in fields and "cuda_graphs" not in ctx.engine_config and ctx.cuda:
        out.append(("cuda_graphs", {**ctx.engine_config, "cuda_graphs": True}))
    return out


def correctness(ctx: Context) -> None:
    """Greedy tokens of the engine against transformers' `generate` for every tiny
    architecture (float32 on the device): 6 prompts at once, one of them chunked."""
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from backends.llm.config import EngineConfig
    from backends.llm.engine import LLMEngine
    from backends.llm.model_runner import ModelRunner
    from backends.llm.sampling_params import SamplingParams
    from backends.tiny import TINY_LLM_ARCHITECTURES, build_tiny_llm

    archs = list(TINY_LLM_ARCHITECTURES)
    if ctx.small:
        archs = [a for a in ("llama", "gemma2", "qwen3_moe") if a in archs]
    new = 8 if ctx.small else 24
    rng = random.Random(7)
    lengths = (5, 23, 70) if ctx.small else (5, 12, 31, 47, 150, 9)
    prompts = [[rng.randrange(7, 500) for _ in range(n)] for n in lengths]
    variants = engine_variants(ctx)
    ctx.set("variants", {name: keys for name, keys in variants})
    results: dict[str, Any] = ctx.set("archs", {})
    for arch in archs:
        with ctx.part(arch, min_left=10) as go:
            if not go:
                continue
            folder = ctx.work / "tiny" / arch
            if not (folder / "config.json").exists():
                window = {"sliding_window": 16} if arch in ("mistral", "gemma2", "gemma3_text",
                                                             "mixtral") else None  # fmt: skip
                build_tiny_llm(folder, arch, config_overrides=window)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                         attn_implementation="eager")  # fmt: skip
            model = model.to(ctx.device).eval()
            expected = []
            with torch.inference_mode():
                for p in prompts:
                    ids = torch.tensor([p], device=ctx.device)
                    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                         max_new_tokens=new, do_sample=False)  # fmt: skip
                    expected.append(out[0, len(p) :].tolist())
            del model
            row: dict[str, Any] = {}
            for name, keys in variants:
                config = EngineConfig(**{"max_num_batched_tokens": 64, "max_num_seqs": 8,
                                         "kv_cache_bytes": 16 * MiB, **keys})  # fmt: skip
                runner = ModelRunner.load(folder, ctx.device, torch.float32, config)
                engine = LLMEngine(config, runner)
                got: dict[str, list[int]] = {}
                for i, p in enumerate(prompts):
                    params = SamplingParams(temperature=0.0, max_tokens=new)
                    engine.add_request(str(i), p, params)
                while engine.has_work():
                    for o in engine.step():
                        got.setdefault(o.request_id, []).extend(o.token_ids)
                same = sum(got.get(str(i)) == e for i, e in enumerate(expected))
                row[name] = {"exact": same, "of": len(prompts)}
                del engine, runner
            results[arch] = row
            ctx.flush()
    exact = sum(r[v]["exact"] for r in results.values() for v in r)
    total = sum(r[v]["of"] for r in results.values() for v in r)
    ctx.set("exact", f"{exact}/{total}")


# ---- footprint --------------------------------------------------------------------------
def footprint(ctx: Context) -> None:
    """Predicted bytes (the manager's prediction on this device) against the measured growth
    of a real load (the allocator's on CUDA, the backend's own count on a CPU)."""
    from backends.encoders.embedder import EmbedderBackend
    from backends.llm.backend import LLMBackend
    from benchmarks.gpu_models import build_embedder, embedder_backend, llm_backend, llm_dir

    def measure(name: str, predict: Callable[[], int], load: Callable[[], Any]) -> None:
        import torch

        predicted = predict()
        ctx.sync()
        before = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
        backend = load()
        ctx.sync()
        grown = torch.cuda.memory_allocated(ctx.device) - before if ctx.cuda else 0
        measured = max(grown, backend.memory_bytes())
        ctx.set(name, {"predicted_bytes": predicted, "measured_bytes": measured,
                       "ratio": round(predicted / max(1, measured), 3)})  # fmt: skip
        backend.unload()

    device = ctx.device if ctx.cuda else None
    with ctx.part("embedder"):
        folder = build_embedder(ctx, tiny=True)
        measure("tiny_embedder", lambda: EmbedderBackend.predict_memory(folder, {}, device=device),
                lambda: embedder_backend(ctx, folder))  # fmt: skip
    with ctx.part("llm", min_left=20):
        folder = llm_dir(ctx)
        config = {"kv_cache_bytes": 64 * MiB, "dtype": "bfloat16" if ctx.cuda else "float32"}
        measure("llm", lambda: LLMBackend.predict_memory(folder, config, device=device),
                lambda: llm_backend(ctx, folder, config))  # fmt: skip


# ---- the tests marked cuda ------------------------------------------------------------------
def cuda_test_files(root: Path) -> list[str]:
    """The test files that mark tests `cuda`, found by their text (collecting the whole suite
    to select them takes longer than the tests), so a new one is never left out."""
    return sorted(
        str(path.relative_to(root))
        for path in (root / "tests").rglob("test_*.py")
        if "mark.cuda" in path.read_text(encoding="utf-8")
    )


def cuda_tests(ctx: Context) -> None:
    """The tests marked `cuda` (skipped in CI, which has no GPU), under what is left of the
    section's time: counts and the names of any that failed."""
    import re
    import subprocess
    import sys

    if not ctx.cuda:
        ctx.set("skipped_reason", "the tests marked cuda need a GPU")
        return
    root = Path(__file__).resolve().parents[1]
    # -v: each test's name and outcome as it ends, so a run the deadline cuts still names
    # its failures.
    command = [sys.executable, "-m", "pytest", "-v", "-rf", "-p", "no:cacheprovider",
               "-m", "cuda", *cuda_test_files(root)]  # fmt: skip
    with ctx.part("pytest"):
        try:
            run = subprocess.run(command, cwd=root, capture_output=True, text=True,
                                 timeout=max(5.0, ctx.left() - 2))  # fmt: skip
            output, rc = run.stdout + run.stderr, run.returncode
        except subprocess.TimeoutExpired as e:
            output, rc = str(e.stdout or "") + "\n(timed out)", None
        print(output[-6000:], flush=True)
        counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", output)}
        ctx.set("rc", rc)
        ctx.set("counts", counts)
        failed = re.findall(r"^FAILED (\S+)", output, re.M)
        failed += [n for n in re.findall(r"^(\S+::\S+) FAILED", output, re.M) if n not in failed]
        ctx.set("passed_so_far", len(re.findall(r"^\S+::\S+ PASSED", output, re.M)))
        ctx.set("failed", failed[:20])


def summarise(merged: dict[str, Any]) -> str:
    """A few lines a reader compares with the issue's table."""
    s = merged["sections"]

    def get(section: str, *path: str) -> Any:
        value: Any = s.get(section, {})
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    rows = [
        ("device", get("environment", "gpu", "name") or merged["run"]["device"]),
        ("engine config", json.dumps(merged["run"]["engine_config"])),
        ("greedy == transformers", get("correctness", "exact")),
        ("64 requests, tok/s: hub", get("throughput", "engine", "tokens_per_s")),
        ("  hub again (warm, other prompts)", get("throughput", "engine_again", "tokens_per_s")),
        ("  transformers static batch", get("hf_static", "result", "tokens_per_s")),
        ("  transformers CB", get("hf_cb", "result", "tokens_per_s")),
        ("  transformers CB + CUDA graphs", get("hf_cb_graphs", "result", "tokens_per_s")),
        ("one stream, ms/token", get("latency", "one_stream", "ms_per_token")),
        ("TTFT, long prompt, ms", get("latency", "one_stream", "ttft_ms")),
        ("prefill step (512 tokens), ms", get("latency", "prefill_step_ms")),
        ("decode step busy share by rows", {k: v.get("busy") for k, v in
                                            (get("latency", "profile") or {}).items()}),
        ("warm restore / pinned copy (acquire, restore)",
         f"{get('restore', 'ratio')}, {get('restore', 'warm_load_ratio')}"),
        ("embeddings: hub / sentence-transformers", get("embeddings", "ratio")),
        ("footprint predicted / measured (embedder, llm)",
         f"{get('footprint', 'tiny_embedder', 'ratio')} / {get('footprint', 'llm', 'ratio')}"),
        ("tests marked cuda", get("cuda_tests", "counts")),
    ]  # fmt: skip
    failed = [n for n, v in s.items() if v.get("errors") or v.get("status") == "running"]
    lines = ["", "gpu_check summary", *(f"  {k:<48} {v}" for k, v in rows)]
    lines.append(f"  sections with errors or cut short: {', '.join(failed) or 'none'}")
    return "\n".join(lines)
