"""Logits to tokens, one row per sequence that samples in the step.

Order of work on a row: log-probabilities of the raw model distribution (what `logprobs`
reports), then the grammar mask of a structured request (disallowed tokens to -inf; the mask
is filled while the model runs, see `Sampler.prepare`), then logit bias and the min_tokens ban
on stop tokens (one indexed add over the batch), repetition / presence / frequency penalties
(`penalties`); greedy rows take the argmax, the others are divided by their temperature, cut
by top-k, top-p and min-p, and sampled. Sampling uses the exponential race (`argmax(p / E)`,
E ~ Exp(1)), which draws exactly `vocab` numbers per token: a seeded sequence owns a generator
that advances the same way whatever else is in the batch, so the same seed gives the same text
in any batch and on any device (`noise`; a grammar mask changes which tokens can win, never
the draws). A batch of plain greedy rows costs one argmax.

The whole step is batched tensor work on the logits' device: what the host knows about the
rows (`plan`) goes to the device in one copy per dtype, and the sampled tokens with any
log-probabilities come back in one copy (`transfer`), the step's only wait for the device.
"""

from backends.llm.sampler.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput"]
