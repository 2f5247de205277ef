"""The cache slots of a chunk of positions against their definition, position by position."""

from __future__ import annotations

import random

from pagedq.worker.engine.model_runner import slot_run


def test_slot_runs_equal_each_positions_block_and_offset():
    rng = random.Random(3)
    for _ in range(200):
        block_size = rng.choice([1, 4, 8, 16])
        table = rng.sample(range(500), 40)
        start = rng.randrange(0, 20 * block_size)
        n = rng.randrange(0, 20 * block_size)
        want = [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        assert slot_run(table, start, n, block_size) == want
