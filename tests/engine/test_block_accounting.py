"""Property tests of the KV bookkeeping over random arrivals, lengths, budgets and aborts.

After every step: a block's reference count equals the number of block tables holding it; a
block is in the free list exactly when its count is 0; for every running sequence, computed
tokens <= known tokens and allocated slots >= computed tokens. After everything ends, every
block is free.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedq.client import SamplingParams
from pagedq.worker import Engine
from pagedq.worker.engine.block_pool import BlockPool


def check_invariants(engine: Engine) -> None:
    pool = engine.kv.pool
    seqs = engine.scheduler.running + engine.scheduler.waiting
    holders = Counter(b for s in seqs for b in s.block_table)
    for block in pool.blocks:
        assert block.ref_count == holders.get(block.block_id, 0), block
        assert (block.block_id in pool._free) == (block.ref_count == 0)
    for s in engine.scheduler.running:
        assert s.num_computed_tokens <= s.num_tokens
        assert len(s.block_table) * engine.kv.block_size >= s.num_computed_tokens
    for s in engine.scheduler.waiting:
        assert s.block_table == [] or s.num_computed_tokens == 0


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return str(tiny_model_dir("llama"))


request_st = st.tuples(
    st.integers(1, 40),  # prompt length
    st.integers(1, 20),  # max_tokens
    st.integers(0, 6),  # arrival step
    st.integers(1, 3),  # n
    st.booleans(),  # aborted midway
    st.integers(0, 2),  # prompt family (shared prefixes hit the prefix cache)
)


def run_arrivals(engine: Engine, requests: list, vocab: int, **params) -> None:
    """Drive ``engine`` through ``requests`` (request_st tuples) arriving at their steps, each
    aborted after 2 tokens where asked, checking the block invariants after every step;
    ``vocab``: prompt ids range over it (small: repetitive prompts), ``params``: more
    SamplingParams fields."""
    pending = sorted(enumerate(requests), key=lambda r: r[1][2])
    step = 0
    aborted = set()
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][2] <= step:
            i, (plen, max_tokens, _, n, abort, family) = pending.pop(0)
            prompt = [(family * 31 + k) % vocab + 3 for k in range(plen)]
            engine.add_request(f"r{i}", prompt, SamplingParams(
                n=n, temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True, **params))
            if abort:
                aborted.add(f"r{i}")
        for out in engine.step():
            if out.request_id in aborted and out.num_generated >= 2:
                engine.abort_request(out.request_id)
        check_invariants(engine)
        step += 1
        assert step < 2000, "engine made no progress"


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(request_st, min_size=1, max_size=8),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(4, 64),
    spare_blocks=st.integers(0, 30),
    prefix=st.booleans(),
)
def test_block_accounting(model_path, requests, block_size, budget, spare_blocks, prefix):
    need = max((p + m) for p, m, *_ in requests)
    num_blocks = -(-need // block_size) + 3 + spare_blocks
    engine = Engine(model_path, block_size=block_size, num_kv_blocks=num_blocks,
                    max_num_batched_tokens=budget, max_num_seqs=4, enable_prefix_caching=prefix)
    run_arrivals(engine, requests, vocab=380)
    pool = engine.kv.pool
    assert pool.num_free == pool.num_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)


def test_pool_lru_evicts_least_recent_cached_block():
    pool = BlockPool(3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.register(a, 111, (1,))
    pool.register(b, 222, (2,))
    for x in (a, b, c):
        pool.release(x)
    # c (uncached) is reused first, then a (freed before b)
    assert pool.allocate() == c
    assert pool.allocate() == a and pool.lookup(111, (1,)) is None
    assert pool.lookup(222, (2,)) == b
    pool.acquire(b)  # a prefix hit revives it
    assert pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.allocate()
