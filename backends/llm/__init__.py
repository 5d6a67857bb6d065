"""Our paged-attention LLM engine, driving Hugging Face decoder-only models.

The parts, one concept a file, from the bottom up:

- `config`: engine settings read once from a model's runtime config.
- `sampling_params`: what a request asks of the sampler, validated on arrival.
- `sequence`: the state of one generated sequence (token ids, progress, blocks).
- `block_pool`, `kv_cache_manager`: the paged KV cache's bookkeeping and prefix cache.
- `scheduler`: which tokens of which sequences run in the next step (a token budget).
- `attention`, `model_runner`: the registered attention function and the forward pass.
- `sampler`: logits to tokens; `detokenizer`: tokens to text, with stop strings.
- `engine`: the step loop; `async_engine`: that loop in a thread behind `async` generators.
- `backend`: the `Backend` contract for the hub; `metrics`: Prometheus series.
- `lora/`: LoRA adapters on the base model: reading and checking PEFT folders, device slots,
  the batched per-token LoRA matmul.

The block pool, KV-cache manager and scheduler are pure Python and never import torch; the
package itself imports nothing so they stay importable (and testable) without it.
"""
