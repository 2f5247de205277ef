"""The packed embedding's row cache against the dequantized table (the plain reference)."""

from __future__ import annotations

import pytest
import torch

from pagedq.kernels.block_formats import dequantize
from pagedq.worker.models.packed_embedding import CACHED_BATCH, PackedEmbedding
from tests.quant_fixtures import random_weight


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q5_0", "q4_k"])
@pytest.mark.parametrize("grouped", [False, True])
def test_cached_rows_equal_the_dequantized_table(fmt, grouped):
    gen = torch.Generator().manual_seed(7)
    weight = random_weight(fmt, 80, 256, gen)
    table = dequantize(weight)
    if grouped:
        weight.set_grouped(True)
    emb = PackedEmbedding(weight, torch.float32, cache_bytes=5 * 256 * 4)  # room for 5 rows
    assert emb.capacity == 5
    for ids in ([3], [3], [9, 3, 9, 60], [1, 2, 3, 4, 5, 6, 7], [60, 9], list(range(CACHED_BATCH + 1))):
        got = emb.rows(torch.tensor(ids))
        torch.testing.assert_close(got, table[ids], rtol=0, atol=0)
        assert len(emb.cached) <= emb.capacity


def test_least_recently_used_rows_leave_first():
    gen = torch.Generator().manual_seed(8)
    emb = PackedEmbedding(random_weight("q8_0", 32, 64, gen), torch.float32, cache_bytes=3 * 64 * 4)
    for t in (1, 2, 3, 1, 4):  # 2 is the least recently used when 4 comes
        emb.rows(torch.tensor([t]))
    assert list(emb.cached) == [3, 1, 4]


def test_a_cached_row_is_not_changed_by_writes_to_the_batch():
    gen = torch.Generator().manual_seed(9)
    weight = random_weight("q4_0", 16, 64, gen)
    emb = PackedEmbedding(weight, torch.float32)
    emb.rows(torch.tensor([5])).zero_()  # the layers write their input in place
    torch.testing.assert_close(emb.rows(torch.tensor([5])), dequantize(weight)[[5]], rtol=0, atol=0)
