"""Speculative decoding: cheap drafts of the next tokens, verified in one target step.

- `ngram`: prompt lookup, drafts copied from the sequence's own prompt and output.
- `draft_model`: a small LLM with the same tokenizer proposes its greedy continuation,
  over its own paged KV cache kept in step with the tokens the target accepted.
- `speculator`: which sequences propose in a step and when speculation turns itself down.
- `verify`: the sampler's rows for the draft positions; acceptance keeps the target's
  distribution (greedy output token for token, sampled output in law).

The scheduler fits drafts into a step and rolls rejected ones' KV slots back; the runner
runs such a step packed, with logits at every draft position.
"""
