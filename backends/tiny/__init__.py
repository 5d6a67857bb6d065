"""Tiny models with random weights, built into a folder on the spot for tests, benchmarks and
the demo: causal LLMs of twelve architectures, a benchmark-sized Llama, a sentence embedder and a
cross-encoder reranker, each with a tokenizer trained locally; and a trained target and draft
LLM pair (`build_trained_pair`) that really predict Python code, for speculative decoding.
Nothing is downloaded; weights are safetensors only and depend on the seed alone (the trained
pair also on the Python version whose standard library it learns from).
"""

from backends.tiny.encoders import build_tiny_embedder, build_tiny_reranker
from backends.tiny.llm import TINY_LLM_ARCHITECTURES, build_benchmark_llm, build_tiny_llm
from backends.tiny.tokenizer import build_tokenizer
from backends.tiny.trained import BENCHMARK_PAIR, QUICK_PAIR, TrainedPair, build_trained_pair

__all__ = [
    "BENCHMARK_PAIR",
    "QUICK_PAIR",
    "TINY_LLM_ARCHITECTURES",
    "TrainedPair",
    "build_benchmark_llm",
    "build_tiny_embedder",
    "build_tiny_llm",
    "build_tiny_reranker",
    "build_tokenizer",
    "build_trained_pair",
]
