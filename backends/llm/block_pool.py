"""The KV cache's blocks as bookkeeping: refcounts, an LRU free queue, the prefix-hash map.

Mechanism only, no policy (that is `KVCacheManager`'s): blocks are numbered `0..num_blocks-1`
and each is either in use (refcount > 0) or in the free queue. A free block may still hold the
KV of a full block of tokens and be findable by its hash: a later request with the same
prefix takes it back out of the queue (a prefix-cache hit). Allocation takes blocks from the
front of the queue, least recently freed first, and forgets their hashes. Pure Python.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class Block:
    __slots__ = ("block_hash", "block_id", "identity", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        # Set once the block is full and registered in the prefix cache.
        self.block_hash: int | None = None
        # The parent block's hash and this block's tokens, compared on a hash hit so that
        # a hash collision never shares KV between different prefixes.
        self.identity: tuple[int, tuple[int, ...]] | None = None


class BlockPool:
    """A fixed set of KV-cache blocks. `allocate` returns None when it cannot be met."""

    def __init__(self, num_blocks: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block id -> block, least recently freed first.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, Block] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now, including cached ones nobody uses."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks (refcount 1), or None when fewer than that are free."""
        if count > len(self._free):
            return None
        ids = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            self._forget(block)
            block.ref_count = 1
            ids.append(block.block_id)
        return ids

    def lookup(self, block_hash: int, parent_hash: int, tokens: tuple[int, ...]) -> int | None:
        """The cached block holding exactly `tokens` after the block `parent_hash`, if any."""
        block = self._cached.get(block_hash)
        if block is None or block.identity != (parent_hash, tokens):
            return None
        return block.block_id

    def share(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones off the queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def register(
        self, block_id: int, block_hash: int, parent_hash: int, tokens: tuple[int, ...]
    ) -> None:
        """Make a full, in-use block findable by its hash. A block already registered under
        this hash wins; the newcomer simply stays private to its sequence."""
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.identity = (parent_hash, tokens)
        self._cached[block_hash] = block

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; unreferenced blocks join the free queue's
        end in the order given (pass a sequence's blocks tail first, so its last blocks,
        the least shareable, are reused first)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = block

    def forget_if_private(self, block_id: int) -> None:
        """Unregister a block only its one holder uses (its contents will not be written)."""
        block = self.blocks[block_id]
        if block.ref_count == 1:
            self._forget(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (after a failed step left KV contents undefined)."""
        for block in list(self._cached.values()):
            self._forget(block)

    def _forget(self, block: Block) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.identity = None
