"""Block pool mechanics: all-or-nothing allocation, LRU reuse, prefix-hash lookups."""

from __future__ import annotations

import pytest

from backends.llm.block_pool import BlockPool

# Torch-free: also run in a bare environment (make test-pure).
pytestmark = pytest.mark.pure


def test_allocation_that_cannot_be_met_returns_none_and_changes_nothing() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [3]


def test_freed_blocks_are_reused_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    first, second = pool.allocate(2), pool.allocate(2)
    assert first is not None and second is not None
    pool.free(second)
    pool.free(first)
    assert pool.allocate(4) == [*second, *first]


def test_shared_block_returns_to_the_queue_only_when_its_last_holder_frees_it() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1) or []
    pool.share([block])
    pool.free([block])
    assert pool.num_free_blocks == 1
    pool.free([block])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([block])


def test_lookup_needs_the_same_parent_and_tokens_not_just_the_hash() -> None:
    pool = BlockPool(4)
    [block] = pool.allocate(1) or []
    pool.register(block, 1234, 0, (5, 6, 7, 8))
    assert pool.lookup(1234, 0, (5, 6, 7, 8)) == block
    assert pool.lookup(1234, 0, (5, 6, 7, 9)) is None  # a hash collision shares nothing
    assert pool.lookup(1234, 99, (5, 6, 7, 8)) is None
    assert pool.lookup(4321, 0, (5, 6, 7, 8)) is None


def test_a_freed_cached_block_can_be_taken_back_until_it_is_reused() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1) or []
    pool.register(block, 42, 0, (1, 2))
    pool.free([block])
    assert pool.lookup(42, 0, (1, 2)) == block
    pool.share([block])  # a prefix hit pulls it off the free queue
    assert pool.num_free_blocks == 1
    pool.free([block])
    assert pool.allocate(2) is not None  # reuse forgets the hash
    assert pool.lookup(42, 0, (1, 2)) is None


def test_prefix_caching_off_registers_nothing() -> None:
    pool = BlockPool(2, enable_prefix_caching=False)
    [block] = pool.allocate(1) or []
    pool.register(block, 42, 0, (1, 2))
    assert pool.lookup(42, 0, (1, 2)) is None
