"""A draft model: a small LLM with the target's tokenizer proposes its greedy continuation.

The draft runs its own `ModelRunner` over its own paged KV cache. For each target sequence
it keeps a mirror `Sequence` (the target's tokens, then the drafts it proposed last) whose
KV is in the draft's cache. Before proposing, the mirror is brought in step with the target:
its tokens become the target's, and its computed tokens are cut back to the prefix both
share, which drops the rejected drafts' KV (blocks past it go back to the draft's pool).
Then one step catches the draft up on the tokens it has not seen (the prompt, the accepted
drafts, the target's own token: usually two or three tokens, chunked by the draft's token
budget) and samples the first draft; up to `num_tokens - 1` single-token steps sample the
rest. Every step batches all proposing sequences. After its first draft (always proposed:
one verify row costs little next to a step, and a first draft lands often), a sequence stops
drafting at the first draft the draft model gives less than `min_confidence` probability
(not proposed), as llama.cpp's `p_min` does: an unsure later draft is seldom accepted, and
costs a draft step and a verify row.

Drafts are the draft model's argmax (with the request's logit bias), point masses, so the
target's acceptance rule keeps its distribution exactly (`backends.llm.speculative.verify`).
A mirror whose blocks do not fit in the draft's cache, or whose tokens would pass the
draft's context, proposes nothing that step.
"""

from __future__ import annotations

import math

import torch

from backends.errors import InputError
from backends.llm.kv_cache_manager import KVCacheManager
from backends.llm.model_runner import ModelRunner
from backends.llm.sampling_params import SamplingParams
from backends.llm.scheduler import ScheduledSequence, SchedulerOutput
from backends.llm.sequence import Sequence

# Threads of a draft step (fused): its work is too small to share out.
DRAFT_THREADS = 1


class DraftModel:
    """Proposes drafts with `runner` (the draft LLM); a `Proposer` for the `Speculator`.
    `max_num_batched_tokens` bounds the tokens of one draft step."""

    def __init__(
        self,
        runner: ModelRunner,
        block_size: int,
        max_num_batched_tokens: int,
        min_confidence: float = 0.0,
    ) -> None:
        """`min_confidence`: drafting for a sequence stops at a token after the first that the
        draft model gives a lower probability (that token is not proposed)."""
        self.runner = runner
        self.min_confidence = min_confidence
        # The draft's steps are small: one thread each, free of the threads' barriers.
        runner.fused.limit_threads(DRAFT_THREADS)
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_cache = KVCacheManager(runner.num_blocks, block_size, enable_prefix_caching=False)
        self._mirrors: dict[int, Sequence] = {}
        # Per mirror: how many of its leading tokens are known to be the target's.
        self._synced: dict[int, int] = {}
        # Draft steps run so far (each a forward pass of the draft model).
        self.steps = 0

    def check_vocab(self, target_vocab_size: int) -> None:
        """InputError when the draft's head does not score the target's vocabulary."""
        if self.runner.vocab_size != target_vocab_size:
            raise InputError(
                f"the draft model scores {self.runner.vocab_size} tokens and the target "
                f"{target_vocab_size}; speculative decoding needs the same tokenizer",
                param="speculative.draft",
            )

    def reset(self) -> None:
        """Forget every mirror (the draft's KV cache was released or allocated anew)."""
        self.kv_cache = KVCacheManager(
            self.runner.num_blocks, self.block_size, enable_prefix_caching=False
        )
        self._mirrors.clear()
        self._synced.clear()

    # ---- Proposer --------------------------------------------------------------------------
    def keep_only(self, seq_ids: set[int]) -> None:
        for seq_id in [i for i in self._mirrors if i not in seq_ids]:
            self._drop(seq_id)

    def propose(self, seqs: list[Sequence], num_tokens: int) -> list[list[int]]:
        mirrors = [self._synced_mirror(seq, num_tokens) for seq in seqs]
        live = [m for m in mirrors if m is not None]
        # Per mirror: how many of its drafts the draft model was sure enough of.
        sure: dict[int, int] = {id(m): 0 for m in live}
        drafting = live
        for i in range(num_tokens):
            if not drafting:
                break
            confidence = self._catch_up(drafting) if i == 0 else self._decode(drafting)
            if i > 0:  # the first draft always goes (a verify row is cheap next to a step)
                drafting = [m for m in drafting if confidence[id(m)] >= self.min_confidence]
            for m in drafting:
                sure[id(m)] += 1
        return [
            [] if m is None else m.token_ids[seq.num_tokens : seq.num_tokens + sure[id(m)]]
            for seq, m in zip(seqs, mirrors, strict=True)
        ]

    # ---- mirrors ---------------------------------------------------------------------------
    def _synced_mirror(self, seq: Sequence, num_tokens: int) -> Sequence | None:
        """`seq`'s mirror holding exactly its tokens, with room for `num_tokens` drafts."""
        mirror = self._mirrors.get(seq.seq_id)
        target = seq.token_ids
        if len(target) + num_tokens > self.runner.max_model_len:
            if mirror is not None:
                self._drop(seq.seq_id)
            return None  # past the draft's context
        if mirror is None:
            mirror = Sequence(
                seq.seq_id,
                seq.request_id,
                target,
                # Greedy (drafts are point masses), biased as the target's request asks; with
                # the sampled token's probability (how sure the draft is).
                SamplingParams(temperature=0.0, logit_bias=seq.params.logit_bias, logprobs=0),
                max_tokens=2**31 - 1,
                block_size=self.block_size,
            )
            self._mirrors[seq.seq_id] = mirror
        else:
            tokens = mirror.token_ids
            same = self._synced[seq.seq_id]
            end = min(len(tokens), len(target))
            while same < end and tokens[same] == target[same]:
                same += 1
            del tokens[same:]
            del mirror.block_hashes[same // self.block_size :]
            for token in target[same:]:
                mirror.append_token(token)
            # The last token runs again even when its KV is there: its logits give the
            # first draft (a sequence the target did not step since the last proposal).
            mirror.num_computed_tokens = min(mirror.num_computed_tokens, same, len(target) - 1)
            self._trim(mirror)
        self._synced[seq.seq_id] = len(target)
        pending = mirror.num_tokens - mirror.num_computed_tokens
        # KV for the pending tokens and every draft but the last (which is never fed back).
        if not self.kv_cache.allocate_slots(mirror, pending + num_tokens - 1):
            self._drop(seq.seq_id)
            return None
        return mirror

    def _trim(self, mirror: Sequence) -> None:
        keep = self.kv_cache.blocks_for(mirror.num_computed_tokens)
        extra = mirror.block_ids[keep:]
        if extra:
            self.kv_cache.pool.free(reversed(extra))
            del mirror.block_ids[keep:]

    def _drop(self, seq_id: int) -> None:
        mirror = self._mirrors.pop(seq_id)
        self._synced.pop(seq_id, None)
        self.kv_cache.free(mirror)
        self.runner.sampler.forget([seq_id])

    # ---- draft steps -------------------------------------------------------------------------
    def _catch_up(self, mirrors: list[Sequence]) -> dict[int, float]:
        """Run each mirror's unseen tokens through the draft and sample its first draft; the
        draft model's probability of each (by `id` of the mirror)."""
        confidence: dict[int, float] = {}
        waiting = list(mirrors)
        while waiting:
            budget = self.max_num_batched_tokens
            items = []
            for m in waiting:
                pending = m.num_tokens - m.num_computed_tokens
                n = min(pending, budget)
                if n <= 0:
                    break
                items.append(ScheduledSequence(m, m.num_computed_tokens, n, n == pending))
                budget -= n
            if not items:
                raise RuntimeError("a draft step with no tokens (the draft budget is 0)")
            confidence.update(self._run(items))
            waiting = [m for m in waiting if id(m) not in confidence]
        return confidence

    def _decode(self, mirrors: list[Sequence]) -> dict[int, float]:
        return self._run([ScheduledSequence(m, m.num_computed_tokens, 1, True) for m in mirrors])

    def _run(self, items: list[ScheduledSequence]) -> dict[int, float]:
        """One draft step; the probability of each sampled draft, by `id` of its mirror."""
        items.sort(key=lambda item: item.num_tokens > 1)  # single tokens first, as scheduled
        output = SchedulerOutput(items, sum(item.num_tokens for item in items))
        sampling = [item.seq for item in items if item.sample]
        logits = self.runner.fused_logits(output)
        if logits is not None:
            tokens, probabilities = _greedy(logits, sampling)
        else:
            sampled = self.runner.execute(output)
            tokens = sampled.token_ids
            probabilities = [1.0 if lp is None else math.exp(lp.logprob) for lp in sampled.logprobs]
        self.steps += 1
        for item in items:
            item.seq.num_computed_tokens = item.start + item.num_tokens
        confidence: dict[int, float] = {}
        for seq, token, probability in zip(sampling, tokens, probabilities, strict=True):
            seq.append_token(token)
            confidence[id(seq)] = probability
        return confidence


def _greedy(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
    """Each row's argmax after its sequence's logit bias (what the sampler's greedy row
    gives), and that token's probability under the model's own distribution (as the
    sampler's log-probability is), without the sampler's per-step set-up."""
    probabilities = torch.softmax(logits, dim=-1)  # (S, V)
    biased = [(i, s.params.logit_bias) for i, s in enumerate(seqs) if s.params.logit_bias]
    if biased:
        logits = logits.clone()
        for i, bias in biased:
            ids = torch.tensor(list(bias), dtype=torch.long)
            logits[i, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype)
    tokens = logits.argmax(dim=-1)  # (S,)
    chosen = probabilities.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()
