"""The encoder backends (embedder, reranker): sentence-transformers models behind the
`Backend` contract, with token-budget dynamic batching.

The parts, one concept a file, from the bottom up:

- `tokenization`: texts and pairs to token ids exactly as sentence-transformers does, fast.
- `batch_items`, `batch_limits`, `batch_work`, `batching`: the dynamic batcher, its limits
  from the runtime config, and its queued work as admission sees it.
- `unpadded`: a batch packed into one row, attention per input.
- `stage_packing`, `fork_server`, `forward_process`: forward passes in worker processes on
  shared weights.
- `encoder`: the lifecycle both kinds share; `embedder`, `reranker`: the two kinds.

What the LLM backend shares with them (errors, loading, parking, admission by queue time,
text bounds, threads, the runtime config) stays at the root of `backends/`; nothing here is
imported by `backends.llm`. The package itself imports nothing, so naming one module does not
load torch through the others.
"""
