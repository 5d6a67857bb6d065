"""Tiny models with random weights, built into a folder on the spot for tests, benchmarks and
the demo: causal LLMs of twelve architectures, a benchmark-sized Llama, a sentence embedder and a
cross-encoder reranker, each with a tokenizer trained locally. Nothing is downloaded; weights
are safetensors only and depend on the seed alone.
"""

from backends.tiny.encoders import build_tiny_embedder, build_tiny_reranker
from backends.tiny.llm import TINY_LLM_ARCHITECTURES, build_benchmark_llm, build_tiny_llm
from backends.tiny.tokenizer import build_tokenizer

__all__ = [
    "TINY_LLM_ARCHITECTURES",
    "build_benchmark_llm",
    "build_tiny_embedder",
    "build_tiny_llm",
    "build_tiny_reranker",
    "build_tokenizer",
]
