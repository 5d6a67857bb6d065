"""A small target LLM and a smaller draft that really predict text, trained on the spot.

Contract: `build_trained_pair(spec, cache_root)` returns a `TrainedPair`: two Hugging Face
folders (`target/` and `draft/`: config.json, generation_config.json, model.safetensors and
the same byte-level BPE tokenizer files) and a report. Both are Llama models trained on the
Python standard library's source (`backends.tiny.stdlib_corpus`), so they load offline with
`transformers` and the hub, and the draft's greedy token often equals the target's: what
speculative decoding needs to be measured (random weights accept nothing).

The build is deterministic for a given spec, Python version (its stdlib is the text) and
torch version: seeded data order and initialisation, training on a fixed number of threads.
It is cached under `cache_root/<spec name>-<hash of the spec and versions>/` and reused once
complete (a folder appears only once whole, so concurrent builders never see half a pair).

Training: the tokenizer is trained on the training files; the target then learns next-token
prediction on random windows of them, a share of the windows being a chunk followed by the
same chunk again, so the model learns to copy what its context already holds (code rewritten
or continued from the prompt, the case prompt lookup serves); the draft learns from the same
windows and from the trained target's distribution (distillation), which raises how often
the two agree. The report (`report.json` in the pair's folder) holds build time, each
model's held-out next-token accuracy, a unigram baseline, and how often the draft's greedy
token equals the target's over held-out positions (the acceptance a draft of one token
would see).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

from backends.tiny.llm import tiny_llm_config
from backends.tiny.stdlib_corpus import Corpus, stdlib_corpus
from backends.tiny.tokenizer import build_tokenizer

# Bumped when the training recipe changes, so old cached pairs are not reused.
_RECIPE_VERSION = 1
_REPORT = "report.json"


@dataclass(frozen=True)
class ModelShape:
    """A Llama's width and depth (head_dim is hidden_size / num_heads)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int


@dataclass(frozen=True)
class PairSpec:
    """Everything a trained pair depends on; the cache key is a hash of it."""

    name: str
    target: ModelShape
    draft: ModelShape
    vocab_size: int
    train_chars: int  # training text, whole files, about this many characters
    held_out_chars: int
    seq_len: int  # tokens per training window
    batch_size: int  # windows per step
    target_steps: int
    draft_steps: int
    learning_rate: float
    copy_fraction: float  # windows made of a chunk and its repeat
    distill_weight: float  # the draft's loss: this much KL to the target, the rest CE
    eval_windows: int  # held-out windows of seq_len scored in the report
    threads: int  # torch threads while training (results depend on it)
    seed: int = 0


# About 20 s of CPU time to build, for tests.
QUICK_PAIR = PairSpec(
    name="quick",
    target=ModelShape(128, 2, 4, 2, 256),
    draft=ModelShape(64, 1, 2, 1, 128),
    vocab_size=1024,
    train_chars=800_000,
    held_out_chars=200_000,
    seq_len=64,
    batch_size=16,
    target_steps=160,
    draft_steps=100,
    learning_rate=2e-3,
    copy_fraction=0.25,
    distill_weight=0.5,
    eval_windows=32,
    threads=1,
)

# About fifteen minutes of CPU time on one core: the pair `benchmarks/speculative.py` measures.
# The target (about 19M parameters, 76 MB in float32) is larger than a server CPU's last-level
# cache, so a decode step streams its weights from memory and verifying a few drafts in one
# step costs little more than one token, as with a real LLM; the draft (0.5M parameters)
# stays in cache, and a draft step costs a few percent of a target step.
BENCHMARK_PAIR = PairSpec(
    name="benchmark",
    target=ModelShape(512, 6, 8, 2, 1408),
    draft=ModelShape(96, 1, 2, 1, 256),
    vocab_size=2048,
    train_chars=4_000_000,
    held_out_chars=400_000,
    seq_len=128,
    batch_size=8,
    target_steps=500,
    draft_steps=300,
    learning_rate=2e-3,
    copy_fraction=0.25,
    distill_weight=0.5,
    eval_windows=128,
    threads=1,
)


@dataclass(frozen=True)
class TrainedPair:
    """The built pair: two model folders sharing one tokenizer, and the build's report."""

    target: Path
    draft: Path
    report: dict[str, Any]


def default_cache_root() -> Path:
    return Path.home() / ".cache" / "model-hub" / "trained-pair"


def pair_folder(spec: PairSpec, cache_root: Path) -> Path:
    """Where `spec`'s pair is cached: named by the spec and a hash of everything it
    depends on (spec, recipe, Python and torch versions)."""
    corpus_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    key = json.dumps(
        {
            "spec": dataclasses.asdict(spec),
            "recipe": _RECIPE_VERSION,
            "python": corpus_version,
            "torch": torch.__version__.split("+")[0],
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return Path(cache_root) / f"{spec.name}-{digest}"


def build_trained_pair(
    spec: PairSpec = BENCHMARK_PAIR, cache_root: Path | None = None, *, progress: bool = True
) -> TrainedPair:
    """The pair of `spec`, from the cache if built before, else trained (minutes for the
    benchmark pair, seconds for `QUICK_PAIR`) and cached; `progress` shows tqdm bars."""
    folder = pair_folder(spec, cache_root or default_cache_root())
    if (folder / _REPORT).is_file():
        report = json.loads((folder / _REPORT).read_text())
        return TrainedPair(folder / "target", folder / "draft", report)
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = folder.with_name(f"{folder.name}.building-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        report = _build(spec, scratch, progress)
        try:
            scratch.rename(folder)
        except OSError:  # another process finished the same pair first: use theirs
            if not (folder / _REPORT).is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return TrainedPair(folder / "target", folder / "draft", report)


@contextlib.contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _build(spec: PairSpec, out: Path, progress: bool) -> dict[str, Any]:
    start, cpu_start = time.perf_counter(), time.process_time()
    corpus = stdlib_corpus(spec.train_chars, spec.held_out_chars)
    tokenizer = build_tokenizer(out / "target", vocab_size=spec.vocab_size, texts=corpus.train)
    tokenizer.save_pretrained(out / "draft")
    train_ids, held_out_ids = _encode(tokenizer, corpus)
    with _torch_threads(spec.threads):
        target = _new_model(spec.target, spec, tokenizer)
        _train(target, None, spec, train_ids, spec.target_steps, "target", progress)
        draft = _new_model(spec.draft, spec, tokenizer)
        _train(draft, target, spec, train_ids, spec.draft_steps, "draft", progress)
        metrics = _evaluate(target, draft, train_ids, held_out_ids, spec)
    _save(target, out / "target")
    _save(draft, out / "draft")
    report = {
        "spec": dataclasses.asdict(spec),
        "python": corpus.python_version,
        "torch": torch.__version__,
        "train_tokens": int(train_ids.numel()),
        "held_out_tokens": int(held_out_ids.numel()),
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "draft_parameters": sum(p.numel() for p in draft.parameters()),
        "build_seconds": round(time.perf_counter() - start, 1),
        # CPU time of this process: the build's cost even on a shared, busy machine.
        "build_cpu_seconds": round(time.process_time() - cpu_start, 1),
        **metrics,
    }
    (out / _REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _encode(tokenizer: PreTrainedTokenizerFast, corpus: Corpus) -> tuple[torch.Tensor, ...]:
    """Each part as one stream of token ids, files separated by the eos token."""
    eos = int(tokenizer.eos_token_id)
    streams = []
    for texts in (corpus.train, corpus.held_out):
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        streams.append(torch.tensor([t for ids in encoded for t in (*ids, eos)]))
    return streams[0], streams[1]


def _new_model(shape: ModelShape, spec: PairSpec, tokenizer: PreTrainedTokenizerFast) -> Any:
    config = tiny_llm_config(
        "llama",
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
        vocab_size=spec.vocab_size,
        max_position_embeddings=4096,
        token_ids={
            "bos_token_id": int(tokenizer.bos_token_id),
            "eos_token_id": int(tokenizer.eos_token_id),
            "pad_token_id": int(tokenizer.pad_token_id),
        },
        # A real initialisation (the random tiny models draw theirs wider on purpose).
        config_overrides={"initializer_range": 0.02},
    )
    torch.manual_seed(spec.seed + shape.hidden_size * 1000 + shape.num_layers)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _batches(ids: torch.Tensor, spec: PairSpec, steps: int) -> Iterator[torch.Tensor]:
    """`steps` batches of windows of seq_len + 1 tokens at seeded random offsets; the first
    `copy_fraction` of each batch is a chunk of half the window followed by that chunk again."""
    generator = torch.Generator().manual_seed(spec.seed)
    span = spec.seq_len + 1
    copies = round(spec.copy_fraction * spec.batch_size)
    half = span // 2 + 1
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - span, (spec.batch_size,), generator=generator)
        rows = [ids[s : s + span] for s in starts.tolist()]
        for i in range(copies):
            chunk = rows[i][:half]
            rows[i] = torch.cat([chunk, chunk])[:span]
        yield torch.stack(rows)


def _learning_rate(spec: PairSpec, step: int, steps: int) -> float:
    """Linear warm-up over the first 5% of steps, then a cosine down to a tenth."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return spec.learning_rate * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return spec.learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def _train(
    model: Any,
    teacher: Any | None,
    spec: PairSpec,
    ids: torch.Tensor,
    steps: int,
    name: str,
    progress: bool,
) -> None:
    """Next-token cross-entropy; with a `teacher`, mixed with KL to its distribution."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.01)
    bar = tqdm(_batches(ids, spec, steps), total=steps, desc=f"training {name}",
               disable=not progress, leave=False)  # fmt: skip
    for step, batch in enumerate(bar):
        inputs, labels = batch[:, :-1], batch[:, 1:]
        logits = model(input_ids=inputs).logits  # (B, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if teacher is not None:
            with torch.no_grad():
                teacher_logits = teacher(input_ids=inputs).logits
            kl = F.kl_div(
                F.log_softmax(logits, -1).flatten(0, 1),
                F.log_softmax(teacher_logits, -1).flatten(0, 1),
                log_target=True,
                reduction="batchmean",
            )
            loss = (1 - spec.distill_weight) * loss + spec.distill_weight * kl
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(spec, step, steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()


@torch.no_grad()
def _evaluate(
    target: Any, draft: Any, train_ids: torch.Tensor, held_out: torch.Tensor, spec: PairSpec
) -> dict[str, float]:
    """Held-out next-token accuracy of each model, of always predicting the training text's
    most frequent token (the unigram baseline), and the greedy agreement of the two."""
    span = spec.seq_len + 1
    # Windows spread evenly over the held-out stream, so every held-out file counts.
    stride = max(span, held_out.numel() // spec.eval_windows)
    starts = range(0, held_out.numel() - span + 1, stride)
    windows = torch.stack([held_out[s : s + span] for s in starts][: spec.eval_windows])
    inputs, labels = windows[:, :-1], windows[:, 1:]
    target_top = target(input_ids=inputs).logits.argmax(-1)
    draft_top = draft(input_ids=inputs).logits.argmax(-1)
    most_frequent = int(torch.bincount(train_ids).argmax())
    return {
        "held_out_positions": int(labels.numel()),
        "target_accuracy": round(float((target_top == labels).float().mean()), 4),
        "draft_accuracy": round(float((draft_top == labels).float().mean()), 4),
        "unigram_accuracy": round(float((labels == most_frequent).float().mean()), 4),
        "draft_target_agreement": round(float((draft_top == target_top).float().mean()), 4),
    }


def _save(model: Any, out: Path) -> None:
    config = model.config
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
