"""The KV manager without a model: block tables, prefix hits, forks and copy-on-write.

Every test ends by checking the pool's reference counts against the block tables that hold
them, and that freeing every sequence returns every block.
"""

from __future__ import annotations

from pagedq.worker.engine.kv_cache_manager import KVCacheManager
from tests.engine.sequences import assert_ref_counts, make_seq

BS = 4


def computed(kv: KVCacheManager, seq, n: int) -> None:
    """Allocate and 'compute' n more tokens of seq (what a step does), committing full blocks."""
    assert kv.allocate(seq, n)
    seq.num_computed_tokens += n
    kv.commit(seq)


def free_all(kv: KVCacheManager, *seqs) -> None:
    for s in seqs:
        kv.free(s)
    assert_ref_counts(kv.pool, [])
    assert kv.pool.num_free == kv.pool.num_blocks


def test_block_table_grows_one_block_per_block_size_tokens():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    seq = make_seq(10)
    computed(kv, seq, 5)
    assert len(seq.block_table) == 2
    computed(kv, seq, 3)
    assert len(seq.block_table) == 2  # 8 tokens still fit in 2 blocks
    seq.token_ids.append(1)
    computed(kv, seq, 1)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert_ref_counts(kv.pool, [seq])
    free_all(kv, seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(3, BS, enable_prefix_caching=False)
    a, b = make_seq(8), make_seq(8)
    computed(kv, a, 8)
    assert kv.blocks_needed(b, 8) == 2 and not kv.allocate(b, 8)
    assert b.block_table == [] and kv.pool.num_free == 1
    assert_ref_counts(kv.pool, [a, b])
    free_all(kv, a, b)


def test_prefix_hit_adopts_cached_blocks_and_leaves_a_token_to_compute():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    prompt = list(range(10, 22))  # 12 tokens: 3 full blocks
    first = make_seq(prompt)
    computed(kv, first, 12)
    kv.free(first)  # its blocks stay cached at ref count 0
    assert kv.pool.num_free == 16
    second = make_seq(prompt + [5, 6])
    hit = kv.match_prefix(second)
    assert len(hit[0]) == 3
    assert kv.allocate(second, 2, hit)
    assert second.block_table[:3] == hit[0] and second.num_computed_tokens == 12
    again = make_seq(prompt)  # the same 12 tokens: the last block is recomputed for logits
    assert len(kv.match_prefix(again)[0]) == 2
    assert_ref_counts(kv.pool, [second])
    free_all(kv, second)


def test_a_prefix_hit_shares_blocks_with_a_running_sequence():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    prompt = list(range(30, 38))
    a = make_seq(prompt + [1])
    computed(kv, a, 9)
    b = make_seq(prompt + [2])
    hit = kv.match_prefix(b)
    assert kv.allocate(b, 1, hit)
    assert b.block_table[:2] == a.block_table[:2]
    assert [kv.pool.ref_count(x) for x in a.block_table[:2]] == [2, 2]
    # computed slots, shared blocks counted once: b's new token has a slot, no KV yet
    assert kv.live_tokens([a, b]) == 8 + 1
    b.num_computed_tokens += 1
    assert kv.live_tokens([a, b]) == 8 + 1 + 1
    assert_ref_counts(kv.pool, [a, b])
    free_all(kv, a, b)


def test_different_tokens_after_the_same_prefix_do_not_hit():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    computed(kv, a, 9)
    b = make_seq([1, 2, 3, 4, 9, 9, 9, 9, 9])
    assert len(kv.match_prefix(b)[0]) == 1  # only the first block is the same
    free_all(kv, a)


def test_without_prefix_caching_nothing_hits():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    a = make_seq(9)
    computed(kv, a, 9)
    assert kv.match_prefix(make_seq(9)) == ([], [])
    free_all(kv, a)


def forked(kv: KVCacheManager, prompt_len: int):
    """A sequence with its prompt computed, and a fork of it sharing its blocks."""
    parent = make_seq(prompt_len)
    computed(kv, parent, prompt_len)
    child = parent.fork(1)
    kv.share(parent, child)
    return parent, child


def test_fork_shares_blocks_and_the_partly_filled_one_is_copied_on_write():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    parent, child = forked(kv, 6)  # one full block and one with 2 of 4 slots used
    assert child.block_table == parent.block_table
    assert [kv.pool.ref_count(b) for b in parent.block_table] == [2, 2]
    assert_ref_counts(kv.pool, [parent, child])

    child.token_ids.append(1)
    assert kv.blocks_needed(child, 1) == 1  # the copy
    assert kv.allocate(child, 1)
    src, dst = kv.take_copies()[0]
    assert src == parent.block_table[1] and child.block_table == [parent.block_table[0], dst]
    assert kv.pool.ref_count(src) == 1 and kv.pool.ref_count(dst) == 1
    assert kv.take_copies() == []  # handed to the model runner once
    parent.token_ids.append(2)
    assert kv.allocate(parent, 1) and kv.take_copies() == []  # its block is its own again
    assert_ref_counts(kv.pool, [parent, child])
    free_all(kv, parent, child)


def test_a_fork_at_a_block_boundary_copies_nothing():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    parent, child = forked(kv, 8)
    child.token_ids.append(1)
    assert kv.allocate(child, 1) and kv.take_copies() == []
    assert child.block_table[:2] == parent.block_table and len(child.block_table) == 3
    assert_ref_counts(kv.pool, [parent, child])
    free_all(kv, parent, child)


def test_commit_registers_only_full_computed_blocks():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    seq = make_seq(10)
    computed(kv, seq, 7)
    assert len(seq.block_hashes) == 1
    computed(kv, seq, 3)
    assert len(seq.block_hashes) == 2
    assert kv.stats([seq])["kv_blocks_used"] == 3
    free_all(kv, seq)
