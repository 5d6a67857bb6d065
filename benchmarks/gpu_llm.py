"""The LLM and encoder sections of `benchmarks/gpu_check.py`: the hub's engine against
transformers (static batch, continuous batching with and without CUDA graphs) on one
workload, its latencies and GPU busy share, a warm restore through the manager, and the
embedder against sentence-transformers.

Workload (the issue's): N requests of random prompts, lengths drawn uniformly in a range,
a fixed number of new tokens each with EOS ignored, greedy; every side gets the same prompts.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_models import (
    build_embedder,
    embedder_backend,
    hf_llm,
    llm_dir,
    llm_dtype,
)
from benchmarks.gpu_sections import Context, median, ms

MiB = 2**20


def workload(
    ctx: Context, n: int | None = None, lengths: tuple[int, int] | None = None
) -> list[list[int]]:
    """`n` prompts (64; 8 small) of 64-512 tokens (16-64 small), ids above the specials."""
    n = n if n is not None else (8 if ctx.small else 64)
    low, high = lengths or ((16, 64) if ctx.small else (64, 512))
    vocab = 4096 if ctx.small else 32000
    rng = random.Random(0)
    return [[rng.randrange(7, vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]


def new_tokens(ctx: Context) -> int:
    return 16 if ctx.small else 128


def make_engine(ctx: Context, **overrides: Any) -> Any:
    """The hub's engine (runner and scheduler, no HTTP) over the LLM, with --engine-config."""
    from backends.llm.config import EngineConfig
    from backends.llm.engine import LLMEngine
    from backends.llm.model_runner import ModelRunner

    keys = {"kv_cache_bytes": (64 if ctx.small else 4096) * MiB, "max_num_seqs": 64,
            "max_num_batched_tokens": 512, **ctx.engine_config, **overrides}  # fmt: skip
    config = EngineConfig(**keys)
    runner = ModelRunner.load(llm_dir(ctx), ctx.device, llm_dtype(ctx), config)
    return LLMEngine(config, runner)


def greedy(n: int) -> Any:
    from backends.llm.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def drain(engine: Any, prompts: list[list[int]], new: int, tag: str) -> dict[str, Any]:
    """Submit every prompt at once and step until done: output tokens per second."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, greedy(new))
    produced, steps = 0, []
    stats = engine.runner.graphs.stats
    static: list[float] = []  # steps that ran the static decode step (replayed or not)
    other: list[float] = []  # the others (prefill chunks, mixed steps)
    ahead = 0  # steps launched before the previous one's tokens landed (async_steps)
    start = time.perf_counter()
    while engine.has_work():
        t = time.perf_counter()
        before = stats.replays + stats.eager_steps
        produced += sum(len(o.token_ids) for o in engine.step())
        steps.append(time.perf_counter() - t)
        ahead += engine.in_flight
        if stats.replays + stats.eager_steps > before:
            static.append(steps[-1])
        else:
            other.append(steps[-1])
    seconds = time.perf_counter() - start
    slowest = sorted(other, reverse=True)[:8]
    return {"output_tokens": produced, "seconds": round(seconds, 3),
            "tokens_per_s": round(produced / seconds, 1), "steps": len(steps),
            "step_ms_median": ms(median(steps)), "static_steps": len(static),
            "static_seconds": round(sum(static), 3),
            "static_step_ms_median": ms(median(static)) if static else None,
            "other_seconds": round(seconds - sum(static), 3),
            "other_step_ms_median": ms(median(other)) if other else None,
            "other_slowest_ms": [ms(t) for t in slowest],
            "launched_ahead": ahead}  # fmt: skip


def throughput(ctx: Context) -> None:
    """The hub's engine on the workload (after a short warm-up run)."""
    prompts, new = workload(ctx), new_tokens(ctx)
    ctx.set("workload", {"requests": len(prompts), "prompt_tokens": [min(map(len, prompts)),
            max(map(len, prompts))], "new_tokens": new, "ignore_eos": True})  # fmt: skip
    engine = None
    with ctx.part("load"):
        start = time.perf_counter()
        engine = make_engine(ctx)
        ctx.set("load_s", round(time.perf_counter() - start, 2))
    if engine is None:
        return
    with ctx.part("warmup"):
        drain(engine, prompts[:4], 4, "warm")
    with ctx.part("engine", min_left=10):
        ctx.set("engine", drain(engine, prompts, new, "run"))
    # The same lengths again with other tokens (no prefix-cache hits): what a warm engine
    # does, every kernel compiled for these shapes by the first run.
    shifted = [[7 + (t + 1000) % (max(p) + 1 - 7) for t in p] for p in prompts]
    with ctx.part("engine_again", min_left=10):
        ctx.set("engine_again", drain(engine, shifted, new, "again"))


def one_stream(ctx: Context, engine: Any, prompt: list[int], new: int) -> dict[str, Any]:
    engine.add_request(f"one-{time.monotonic_ns()}", prompt, greedy(new))
    start = time.perf_counter()
    times = []
    while engine.has_work():
        if any(o.token_ids for o in engine.step()):
            times.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {"prompt_tokens": len(prompt), "ttft_ms": ms(times[0] - start),
            "ms_per_token": ms(median(gaps))}  # fmt: skip


def busy_share(ctx: Context, engine: Any, rows: int) -> dict[str, Any]:
    """Device time of a decode step's kernels over its wall time, at `rows` sequences
    (torch.profiler over a few steady decode steps)."""
    from torch.profiler import ProfilerActivity, profile

    for i, p in enumerate(workload(ctx, rows, (32, 32))):
        engine.add_request(f"prof{rows}-{i}", p, greedy(12))
    started: set[str] = set()
    while len(started) < rows and engine.has_work():  # through the prefill
        started.update(o.request_id for o in engine.step() if o.token_ids)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    steps = 4
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        ctx.sync()
        wall = (time.perf_counter() - start) / steps
    while engine.has_work():
        engine.step()
    events = prof.key_averages()
    host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    top_host = [[e.key[:60], e.count // steps, round(e.self_cpu_time_total / steps)]
                for e in host]  # fmt: skip
    python = host_profile(engine, ctx, rows)
    if ctx.cuda:
        device_us = sum(e.self_device_time_total for e in events) / steps
        kernels = sum(e.count for e in events if e.self_device_time_total > 0) / steps
        top = sorted(events, key=lambda e: -e.self_device_time_total)[:12]
        top_device = [[e.key[:60], e.count // steps, round(e.self_device_time_total / steps)]
                      for e in top]  # fmt: skip
    else:  # a CPU is busy for the whole step: only the wall time means something
        return {"step_ms": ms(wall), "device_ms": None, "busy": None, "kernels_per_step": None,
                "top_host_us": top_host, "python": python}  # fmt: skip
    return {"step_ms": ms(wall), "device_ms": round(device_us / 1000, 3),
            "busy": round(device_us / 1e6 / wall, 3), "kernels_per_step": kernels,
            "top_device_us": top_device, "top_host_us": top_host,
            "python": python}  # fmt: skip


def mixed_step(ctx: Context, engine: Any) -> dict[str, Any]:
    """A step holding a prefill chunk beside running decodes (32 of them and a 448-token
    prompt; 4 and 48 small), which runs eagerly: its wall time, its kernels, and where its
    host time goes (cProfile's top functions by own time)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    decodes, chunk = (4, 48) if ctx.small else (32, 448)
    for i, p in enumerate(workload(ctx, decodes, (32, 32))):
        engine.add_request(f"mix-{i}", p, greedy(8))
    started: set[str] = set()
    while len(started) < decodes and engine.has_work():
        started.update(o.request_id for o in engine.step() if o.token_ids)
    result: dict[str, Any] = {"decodes": decodes, "prefill_tokens": chunk}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    for k, mode in enumerate(("wall", "kernels", "python")):
        [prompt] = workload(ctx, 1, (chunk, chunk))
        engine.add_request(f"mix-prefill-{k}", [9 + k, *prompt[1:]], greedy(1))
        ctx.sync()
        if mode == "wall":
            t = time.perf_counter()
            engine.step()
            ctx.sync()
            result["step_ms"] = ms(time.perf_counter() - t)
        elif mode == "kernels":
            with profile(activities=activities) as prof:
                engine.step()
                ctx.sync()
            events = prof.key_averages()
            result["kernels"] = sum(e.count for e in events if e.self_device_time_total > 0)
        else:
            profiler = cProfile.Profile()
            profiler.enable()
            engine.step()
            ctx.sync()
            profiler.disable()
            table = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
            top = sorted(table.items(), key=lambda kv: -kv[1][2])[:15]
            result["python"] = [f"{Path(f).name}:{line}:{name} {calls} {tt * 1e6:.0f}us"
                                for (f, line, name), (_, calls, tt, _, _) in top]  # fmt: skip
    while engine.has_work():
        engine.step()
    return result


def host_profile(engine: Any, ctx: Context, rows: int) -> list[str]:
    """Where the host's time goes in steady decode steps at `rows` sequences: cProfile's
    top functions by own time (name, calls per step, microseconds per step)."""
    import cProfile
    import pstats

    for i, p in enumerate(workload(ctx, rows, (32, 32))):
        engine.add_request(f"cprof{rows}-{i}", p, greedy(16))
    started: set[str] = set()
    while len(started) < rows and engine.has_work():
        started.update(o.request_id for o in engine.step() if o.token_ids)
    steps = 8
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    while engine.has_work():
        engine.step()
    stats = pstats.Stats(profiler)
    table = stats.stats  # type: ignore[attr-defined]
    top = sorted(table.items(), key=lambda kv: -kv[1][2])[:20]
    return [
        f"{Path(f).name}:{line}:{name} {calls // steps} {tt / steps * 1e6:.0f}us "
        f"cum {ct / steps * 1e6:.0f}us"
        for (f, line, name), (_, calls, tt, ct, _) in top
    ]


def latency(ctx: Context) -> None:
    """One stream (ms per token, TTFT of a 496-token prompt), a 512-token prefill step, and
    the GPU's busy share of a decode step at 1 and 64 rows."""
    engine = make_engine(ctx)
    long = 48 if ctx.small else 496
    with ctx.part("warmup"):
        drain(engine, workload(ctx, 2, (8, 8)), 4, "warm")
    with ctx.part("one_stream"):
        [prompt] = workload(ctx, 1, (long, long))
        ctx.set("one_stream", one_stream(ctx, engine, prompt, 32 if ctx.small else 128))
    with ctx.part("prefill_step"):
        size = 64 if ctx.small else 512
        times = []
        for i in range(3):
            [prompt] = workload(ctx, 1, (size, size))
            engine.add_request(f"pf-{i}", [7 + i, *prompt[1:]], greedy(1))
            ctx.sync()
            t = time.perf_counter()
            engine.step()
            ctx.sync()
            times.append(time.perf_counter() - t)
            while engine.has_work():
                engine.step()
        ctx.set("prefill_tokens", size)
        ctx.set("prefill_step_ms", ms(median(times[1:])))
    with ctx.part("mixed_step", min_left=10):
        ctx.set("mixed_step", mixed_step(ctx, engine))
    profile: dict[str, Any] = ctx.set("profile", {})
    for rows in (1, 8 if ctx.small else 64):
        with ctx.part(f"profile_{rows}", min_left=8):
            profile[f"rows_{rows}"] = busy_share(ctx, engine, rows)
            ctx.flush()


def _hf_timed(ctx: Context, run: Any, produced_of: Any) -> dict[str, Any]:
    ctx.sync()
    start = time.perf_counter()
    result = run()
    ctx.sync()
    seconds = time.perf_counter() - start
    produced = produced_of(result)
    return {"output_tokens": produced, "seconds": round(seconds, 3),
            "tokens_per_s": round(produced / seconds, 1)}  # fmt: skip


def hf_static(ctx: Context) -> None:
    """transformers `generate` over one left-padded batch of the whole workload (sdpa)."""
    import torch

    model = hf_llm(ctx)
    prompts, new = workload(ctx), new_tokens(ctx)
    longest = max(map(len, prompts))
    ids = torch.full((len(prompts), longest), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    ids, mask = ids.to(ctx.device), mask.to(ctx.device)

    def run(n: int) -> Any:
        with torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False)  # fmt: skip

    with ctx.part("warmup"):
        run(2)
    with ctx.part("generate", min_left=10):
        out = _hf_timed(ctx, lambda: run(new), lambda r: (r.shape[1] - longest) * r.shape[0])
        ctx.set("result", out)


def _hf_continuous(ctx: Context, graphs: bool) -> None:
    """transformers' continuous batching over the workload, as its own benchmarks run it: a
    manager opened with the workload's hints (longest prompt, new tokens, request count), its
    warm-up (with `graphs`, the capture of its CUDA graphs; a GPU only) timed apart, then every
    request added at once and their results collected."""
    import logging

    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    if graphs and not ctx.cuda:
        ctx.set("skipped_reason", "CUDA graphs need a GPU")
        return
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    model = hf_llm(ctx)
    prompts, new = workload(ctx), new_tokens(ctx)
    gen = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=2, max_new_tokens=new)
    # On a GPU the cache takes a share of free memory, as in transformers' own benchmarks; a
    # CPU dry run sizes it to the toy workload (a share of host memory takes minutes).
    size: dict[str, Any] = (
        {"num_blocks": 64, "max_batch_tokens": 256} if ctx.small else {"max_memory_percent": 0.3}
    )
    cb = ContinuousBatchingConfig(use_cuda_graph=graphs, **size)
    hints = WorkloadHints(max_prompt_length=max(map(len, prompts)), max_generated_length=new,
                          num_requests=len(prompts))  # fmt: skip
    with ctx.part("continuous_batching", min_left=10):
        start = time.perf_counter()
        with model.continuous_batching_context_manager(
            generation_config=gen, block=True, timeout=10, continuous_batching_config=cb,
            workload_hints=hints,
        ) as manager:  # fmt: skip
            ctx.set("warmup_s", round(time.perf_counter() - start, 2))
            ctx.sync()
            start = time.perf_counter()
            ids = manager.add_requests(inputs=prompts, max_new_tokens=new)
            produced = finished = 0
            stop_at = time.time() + max(3.0, ctx.left() - 5)
            while finished < len(ids) and time.time() < stop_at:
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        ctx.set("manager_stopped", True)
                        break
                    continue
                if result.is_finished():
                    finished += 1
                    produced += len(result.generated_tokens)
            seconds = time.perf_counter() - start
            if finished < len(ids):
                ctx.set("incomplete", f"{finished}/{len(ids)} finished before the deadline")
                manager.stop(block=False)
        ctx.set("result", {"output_tokens": produced, "seconds": round(seconds, 3),
                           "tokens_per_s": round(produced / seconds, 1)})  # fmt: skip


def hf_cb(ctx: Context) -> None:
    _hf_continuous(ctx, graphs=False)


def hf_cb_graphs(ctx: Context) -> None:
    _hf_continuous(ctx, graphs=True)


def restore(ctx: Context) -> None:
    """A warm restore of the LLM through the manager (parked in the host tier, brought back
    by a request) against a plain pinned host-to-device copy of as many bytes: `ratio` is
    the median acquire that restores over the fastest copy, `warm_load_ratio` the same for
    the manager's own timing of the restore (`warm_load_s`, without the acquire around it).
    Nothing else is timed: no other model is evicted and no token generated."""
    import torch

    from benchmarks.gpu_manager import folder_manager

    async def measure() -> None:
        manager = folder_manager(ctx, llm_dir(ctx))
        acquires: list[float] = []
        warm_loads: list[float] = []
        try:
            async with manager.acquire("llm", 1):
                pass
            for _ in range(3):
                assert manager.release_copy("llm", 1, reason="gpu_check")
                while (row := manager.status()[0]).state != "warm":  # noqa: ASYNC110
                    await asyncio.sleep(0.01)  # the manager has no event for "parked"
                start = time.perf_counter()
                async with manager.acquire("llm", 1):
                    pass
                acquires.append(time.perf_counter() - start)
                warm_loads.append(manager.status()[0].warm_load_s or 0.0)
                ctx.set("host_bytes", row.host_bytes)
                ctx.set("restore_ms_each", [ms(s) for s in acquires])
                ctx.set("restore_ms", ms(median(acquires)))
                ctx.set("warm_load_ms", ms(median(warm_loads)))
        finally:
            await manager.close()

    with ctx.part("manager"):
        asyncio.run(measure())
    with ctx.part("pinned_copy"):
        nbytes = int(ctx.data.get("host_bytes") or 64 * MiB)
        host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=ctx.cuda)
        target = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
        copies = []
        for _ in range(3):
            ctx.sync()
            t = time.perf_counter()
            target.copy_(host, non_blocking=True)
            ctx.sync()
            copies.append(time.perf_counter() - t)
        ctx.set("pinned_copy_ms", ms(min(copies)))
    copy_ms = ctx.data.get("pinned_copy_ms")
    if copy_ms:
        for key, ratio in (("restore_ms", "ratio"), ("warm_load_ms", "warm_load_ratio")):
            if ctx.data.get(key):
                ctx.set(ratio, round(ctx.data[key] / copy_ms, 2))


def embeddings(ctx: Context) -> None:
    """The hub's embedder (its default dtype on the device: float16 on a GPU) against
    sentence-transformers' `encode` in float32 and in float16, batches of 32 texts, and how
    closely the hub's vectors agree with float32 ones (the lowest cosine)."""
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    folder = build_embedder(ctx)
    rng = random.Random(3)
    words = ["model", "hub", "serving", "memory", "device", "token", "batch", "query"]
    count = 64 if ctx.small else 256
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 60))) for _ in range(count)]
    batches = [texts[i : i + 32] for i in range(0, len(texts), 32)]
    rounds = 1 if ctx.small else 3
    vectors: dict[str, Any] = {}
    backend = embedder_backend(ctx, folder)
    timings = _time_stages(backend._require())
    with ctx.part("hub"):
        ctx.set("hub_dtype", str(next(backend.model.parameters()).dtype))

        async def run() -> float:
            for b in batches[:2]:
                await backend.embed(b)
            start = time.perf_counter()
            for _ in range(rounds):
                for b in batches:
                    await backend.embed(b)
            seconds = time.perf_counter() - start
            vectors["hub"] = np.concatenate([(await backend.embed(b)).vectors for b in batches])
            return seconds

        seconds = asyncio.run(run())
        ctx.set("hub_texts_per_s", round(rounds * len(texts) / seconds, 1))
        stage_use = {
            name: {"calls": len(t), "inputs": sum(n for n, _ in t),
                   "seconds": round(sum(x for _, x in t), 3)}
            for name, t in timings.items()
        }  # fmt: skip
        ctx.set("hub_batcher_stages", stage_use)
    with ctx.part("hub_stages"):
        # The same tokenize and forward in this thread, without the batcher's queue and its
        # threads: what the hub's batching costs beyond the compute.
        from backends.encoders.embedder import _EmbedRequest

        stages = backend._require()
        start = time.perf_counter()
        for _ in range(rounds):
            for b in batches:
                items = stages.tokenize([_EmbedRequest(b, True)])[0]
                assert isinstance(items, list)
                stages.forward(items)
        ctx.set("hub_stages_texts_per_s",
                round(rounds * len(texts) / (time.perf_counter() - start), 1))  # fmt: skip
    backend.unload()
    dtypes = {"st": torch.float32, "st_fp16": torch.float16} if ctx.cuda else {"st": None}
    for name, dtype in dtypes.items():
        with ctx.part(name):
            kwargs = {"model_kwargs": {"dtype": dtype}} if dtype is not None else {}
            model = SentenceTransformer(str(folder), device=ctx.device, **kwargs)
            model.encode(batches[0], batch_size=32)
            start = time.perf_counter()
            for _ in range(rounds):
                for b in batches:
                    model.encode(b, batch_size=32)
            ctx.sync()
            ctx.set(f"{name}_texts_per_s",
                    round(rounds * len(texts) / (time.perf_counter() - start), 1))  # fmt: skip
            vectors[name] = np.asarray(model.encode(texts, batch_size=32), dtype=np.float32)
            del model
    if "hub" in vectors and "st" in vectors:
        a, b = vectors["hub"], vectors["st"]
        a = a / np.linalg.norm(a, axis=1, keepdims=True)
        b = b / np.linalg.norm(b, axis=1, keepdims=True)
        ctx.set("min_cosine_vs_st_float32", round(float(np.sum(a * b, axis=1).min()), 6))
    for name in dtypes:
        if ctx.data.get("hub_texts_per_s") and ctx.data.get(f"{name}_texts_per_s"):
            ratio = ctx.data["hub_texts_per_s"] / ctx.data[f"{name}_texts_per_s"]
            ctx.set("ratio" if name == "st" else f"ratio_vs_{name}", round(ratio, 2))


def _time_stages(stages: Any) -> dict[str, list[tuple[int, float]]]:
    """Record each `tokenize` and `forward` call the batcher makes on `stages` (inputs,
    seconds): whether the batcher's time is the stages' own or the hand-offs between them."""
    timings: dict[str, list[tuple[int, float]]] = {"tokenize": [], "forward": []}
    for name, record in timings.items():
        original = getattr(stages, name)

        def timed(items: Any, _original: Any = original, _record: Any = record) -> Any:
            start = time.perf_counter()
            result = _original(items)
            _record.append((len(items), time.perf_counter() - start))
            return result

        setattr(stages, name, timed)
    return timings
