"""The block pool on its own: reference counts, the free list's order, the prefix index."""

from __future__ import annotations

import pytest

from pagedq.worker.engine.block_pool import BlockPool, NoFreeBlocksError, hash_block


def test_ref_counts_follow_acquire_and_release():
    pool = BlockPool(4)
    b = pool.allocate()
    assert pool.ref_count(b) == 1 and pool.num_used == 1 and pool.num_free == 3
    pool.acquire(b)
    pool.release(b)
    assert pool.ref_count(b) == 1 and pool.num_free == 3
    pool.release(b)
    assert pool.ref_count(b) == 0 and pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.release(b)


def test_exhausted_pool_raises():
    pool = BlockPool(2)
    pool.allocate()
    pool.allocate()
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


def test_cached_blocks_are_evicted_last_and_least_recently_freed_first():
    pool = BlockPool(4)
    a, b, c, d = (pool.allocate() for _ in range(4))
    pool.register(a, hash_block(None, (1,)), (1,))
    pool.register(b, hash_block(None, (2,)), (2,))
    for x in (a, b, c, d):
        pool.release(x)
    # uncached c and d are reused first (most recently freed at the front), then a, then b
    assert [pool.allocate() for _ in range(4)] == [d, c, a, b]
    assert pool.num_evictions == 2
    assert pool.lookup(hash_block(None, (1,)), (1,)) is None


def test_acquire_revives_a_freed_cached_block():
    pool = BlockPool(2)
    a = pool.allocate()
    h = hash_block(None, (5, 6))
    pool.register(a, h, (5, 6))
    pool.release(a)
    assert pool.lookup(h, (5, 6)) == a and pool.num_free == 2
    pool.acquire(a)
    assert pool.ref_count(a) == 1 and pool.num_free == 1
    assert pool.allocate() != a  # it is in use again, not on the free list


def test_lookup_checks_the_tokens_and_the_first_writer_wins():
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    h = hash_block(None, (1, 2))
    pool.register(a, h, (1, 2))
    pool.register(b, h, (1, 2))  # a duplicate: the index keeps a
    assert pool.lookup(h, (1, 2)) == a
    assert pool.lookup(h, (9, 9)) is None  # a hash collision never returns other tokens


def test_chained_hash_depends_on_the_parent():
    assert hash_block(None, (1, 2)) != hash_block(hash_block(None, (0,)), (1, 2))


def test_without_caching_nothing_is_registered():
    pool = BlockPool(2, enable_caching=False)
    a = pool.allocate()
    pool.register(a, 123, (1,))
    assert pool.lookup(123, (1,)) is None


def test_reset_cache_forgets_every_prefix():
    pool = BlockPool(2)
    a = pool.allocate()
    pool.register(a, 7, (7,))
    pool.release(a)
    pool.reset_cache()
    assert pool.lookup(7, (7,)) is None and pool.num_free == 2
