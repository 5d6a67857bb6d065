"""Which blocks a sequence gets: prefix-cache lookups, slot allocation, freeing. Pure Python.

Policy over `BlockPool`'s mechanism. A sequence's block table is `seq.block_ids`; block `i`
holds the KV of tokens `[i * block_size, (i + 1) * block_size)`. A full block is registered
in the prefix cache as soon as the step that fills it is scheduled: the runner writes every
layer's new KV before any attention reads it, so another sequence scheduled in the same step
(the other samples of an `n > 1` request, say) may already share it.
"""

from __future__ import annotations

from backends.llm.block_pool import BlockPool
from backends.llm.sequence import Sequence


class KVCacheManager:
    """Allocates KV blocks to sequences. `allocate_slots` either meets the whole request or
    changes nothing and returns False; what to do then (preempt, wait) is the scheduler's."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching=enable_prefix_caching)
        # Prompt tokens looked up in the prefix cache, and how many of them were found.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by live sequences (cached free blocks count as free)."""
        return self.pool.usage

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of `seq`'s full blocks. The last token
        is never covered: it must run through the model to produce the next token's logits."""
        if not self.enable_prefix_caching or seq.num_computed_tokens:
            return []
        hits: list[int] = []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for i in range(max_blocks):
            parent = seq.block_hashes[i - 1] if i else seq.root_hash
            block_id = self.pool.lookup(seq.block_hashes[i], parent, seq.block_tokens(i))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached_blocks: list[int] | None = None,
        *,
        num_lookahead: int = 0,
    ) -> bool:
        """Give `seq` room for `num_new_tokens` more tokens after its computed ones (and after
        `cached_blocks`, a prefix hit taken on admission), plus `num_lookahead` draft tokens
        after those (speculative decoding: never registered in the prefix cache, see
        `rollback`). On success the cached blocks are in the block table and counted as
        computed; on failure nothing changed."""
        if cached_blocks is None and not num_lookahead:
            # A running sequence's next tokens, most often a decode within its last block.
            computed = seq.num_computed_tokens
            total = computed + num_new_tokens
            if total <= len(seq.block_ids) * self.block_size:
                self._register_full_blocks(seq, computed, total)
                return True
        cached = cached_blocks or []
        num_cached_tokens = len(cached) * self.block_size
        computed = seq.num_computed_tokens + num_cached_tokens
        total = computed + num_new_tokens
        needed = self.blocks_for(total + num_lookahead) - len(seq.block_ids) - len(cached)
        # Cached blocks nobody holds sit in the free queue; sharing them shrinks it.
        reclaimed = sum(1 for b in cached if self.pool.blocks[b].ref_count == 0)
        if needed > self.pool.num_free_blocks - reclaimed:
            return False
        if cached_blocks is not None and self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += num_cached_tokens
        if cached:
            self.pool.share(cached)
            seq.block_ids.extend(cached)
            seq.num_computed_tokens = computed
            seq.num_cached_tokens = num_cached_tokens
        if needed > 0:
            new_blocks = self.pool.allocate(needed)
            assert new_blocks is not None  # checked above
            seq.block_ids.extend(new_blocks)
        self._register_full_blocks(seq, computed, total)
        return True

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks, tail first. Blocks past its computed tokens were
        registered for a step that will not run for it now, so they are forgotten; the
        others stay findable in the prefix cache until reused."""
        for block_id in seq.block_ids[seq.num_computed_tokens // self.block_size :]:
            self.pool.forget_if_private(block_id)
        self.pool.free(reversed(seq.block_ids))
        seq.block_ids = []

    def rollback(self, seq: Sequence, verified_from: int) -> None:
        """After a step that verified drafts from position `verified_from` on: keep the blocks
        that hold `seq`'s computed tokens, free the ones only rejected drafts wrote, and
        register the blocks that accepted drafts filled. A rejected draft's KV left in a kept
        block sits past the computed tokens, where nothing reads it before it is written."""
        keep = self.blocks_for(seq.num_computed_tokens)
        extra = seq.block_ids[keep:]
        if extra:
            self.pool.free(reversed(extra))
            del seq.block_ids[keep:]
        self._register_full_blocks(seq, verified_from, seq.num_computed_tokens)

    def register_computed(self, seq: Sequence, start: int, end: int) -> None:
        """Register the full blocks that positions `[start, end)` of `seq` complete (those
        with a hash; again is harmless)."""
        self._register_full_blocks(seq, start, end)

    def register_filled(self, seq: Sequence) -> None:
        """After a token in flight landed: register the block it filled, if the step that
        computes that token's KV is already scheduled (else that step's allocation will)."""
        if not self.enable_prefix_caching:
            return
        n = len(seq.token_ids)
        i = n // self.block_size - 1
        if n % self.block_size or seq.num_computed_tokens < n or i >= len(seq.block_ids):
            return
        parent = seq.block_hashes[i - 1] if i else seq.root_hash
        self.pool.register(seq.block_ids[i], seq.block_hashes[i], parent, seq.block_tokens(i))

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def _register_full_blocks(self, seq: Sequence, computed: int, total: int) -> None:
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        # A block whose last token is still in flight (asynchronous steps) has no hash yet:
        # `register_filled` registers it when that token lands.
        for i in range(computed // bs, min(total // bs, len(seq.block_hashes))):
            parent = seq.block_hashes[i - 1] if i else seq.root_hash
            self.pool.register(seq.block_ids[i], seq.block_hashes[i], parent, seq.block_tokens(i))
