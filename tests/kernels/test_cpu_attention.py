"""The C++ paged-attention kernel (csrc/attention.cpp) against the plain reference (reference.py).

The kernel is called directly with rows for *every* query token (decodes and whole prefill
chunks, whatever their length), so it is checked on its own; then through ``paged_attention``,
where the "cpp" backend sends decodes and short chunks to it and longer chunks to SDPA. Every
case scatters K/V over shuffled physical blocks of a NaN-filled cache: a read of an unused slot
shows up as NaN.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedq.kernels import paged_attention, plan_attention, reference_paged_attention
from pagedq.kernels.cases import make_case
from pagedq.kernels.cpu_attention import (
    MAX_KERNEL_CHUNK,
    MAX_KERNEL_CHUNK_KEYS,
    items_heads,
    kernel_rows,
    kernel_takes,
    kernel_takes_step,
)
from tests.kernels.test_torch_attention import scenarios

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@pytest.fixture(scope="module")
def op(cpu_ops):
    return cpu_ops.paged_attention_rows


def run_all_rows(op, case, heads_per_item: int | None = None, grain: int = 1) -> torch.Tensor:
    """The kernel over every query token of ``case``; rows of q_len-0 sequences stay zero."""
    plan = plan_attention(case.block_table, case.seq_lens, case.cu_seqlens_q, case.block_size)
    ids = [i for i, q in enumerate(plan.q_lens) if q > 0]
    num_kv_heads = case.k_cache.shape[2]
    rows = kernel_rows(plan, ids, num_kv_heads)
    out = torch.zeros_like(case.query)
    scale = case.query.shape[-1] ** -0.5
    hpi = rows.heads_per_item if heads_per_item is None else heads_per_item
    op(out, case.query, case.k_cache, case.v_cache, rows.block_table, rows.rows, scale, hpi, grain)
    return out


def assert_matches_reference(case, out: torch.Tensor) -> None:
    ref = reference_paged_attention(*case.attention_args())
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[case.query.dtype])


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("scenario", list(scenarios(8)))
def test_kernel_matches_reference(op, block_size, group, scenario):
    q_lens, ctx = scenarios(block_size)[scenario]
    case = make_case(q_lens, ctx, num_heads=2 * group, num_kv_heads=2, head_dim=32,
                     block_size=block_size, seed=block_size * group)  # fmt: skip
    assert_matches_reference(case, run_all_rows(op, case))


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("head_dim", [8, 24, 64, 128])
def test_every_group_size_and_head_dim(op, group, head_dim):
    """All register tilings: 1-4 query rows per tile, D not a multiple of the 32-wide V tile."""
    case = make_case([1, 1, 7, 1], [5, 40, 19, 3], num_heads=2 * group, num_kv_heads=2,
                     head_dim=head_dim, block_size=16, seed=group + head_dim)  # fmt: skip
    assert_matches_reference(case, run_all_rows(op, case))


@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_unusual_block_sizes_and_long_contexts(op, block_size):
    """Blocks shorter than a token tile or the prefetch step; contexts of hundreds of blocks."""
    case = make_case([1, 3, 1], [700 // block_size * block_size - 1, 50, 301], num_heads=9,
                     num_kv_heads=3, head_dim=64, block_size=block_size, seed=block_size)  # fmt: skip
    assert_matches_reference(case, run_all_rows(op, case))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decodes_over_one_shared_prefix(op, kv_dtype):
    """A tool-call step's shape: decode rows over one cached prompt prefix (the tool list), 9
    query heads over 3 KV heads, head_dim 64, block 8, lengths off the 4-token tile; the rows
    read the same physical blocks, as prefix caching leaves them."""
    ctx = [457 + 3 * i for i in range(12)]
    case = make_case([1] * 12, ctx, num_heads=9, num_kv_heads=3, head_dim=64, block_size=8, seed=5)
    case.block_table[1:, :57] = case.block_table[0, :57]
    low = dataclasses.replace(case, k_cache=case.k_cache.to(kv_dtype),
                              v_cache=case.v_cache.to(kv_dtype))
    rounded = dataclasses.replace(case, k_cache=low.k_cache.float(), v_cache=low.v_cache.float())
    assert_matches_reference(rounded, run_all_rows(op, low))


@pytest.mark.parametrize("group", [1, 4, 5])
def test_groups_of_rows_sharing_different_prefixes(op, group):
    """Two prefixes, one member diverging early (its group shares only what all see), and a
    prefill chunk whose rows share their own sequence's blocks; 1, 4 and 5 query rows per KV
    head, head_dim 128."""
    ctx = [300 + 5 * i for i in range(6)] + [200 + 7 * i for i in range(6)] + [150]
    case = make_case([1] * 12 + [9], ctx, num_heads=2 * group, num_kv_heads=2, head_dim=128,
                     block_size=16, seed=group)  # fmt: skip
    case.block_table[1:6, :18] = case.block_table[0, :18]
    case.block_table[7:12, :12] = case.block_table[6, :12]
    case.block_table[11, 3:12] = case.block_table[0, 3:12]  # same first blocks, then its own
    assert_matches_reference(case, run_all_rows(op, case))


def test_a_member_that_sees_only_the_shared_keys(op):
    """The shared pass's partial sums are a whole row's softmax when the row has no keys of its
    own (its length is exactly the shared prefix): the merge adds nothing and rescales by 1."""
    ctx = [448, 448, 461, 470, 500]
    case = make_case([1] * 5, ctx, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, seed=9)
    case.block_table[1:, :28] = case.block_table[0, :28]
    assert_matches_reference(case, run_all_rows(op, case))


def test_the_shared_pass_runs_under_inference_mode(op):
    """The engine calls the kernel under torch.inference_mode: the shared pass's matrix products
    (ATen ops on tensors it makes) must run where that mode holds, not in worker threads."""
    ctx = [300 + 5 * i for i in range(8)]
    case = make_case([1] * 8, ctx, num_heads=9, num_kv_heads=3, head_dim=64, block_size=8, seed=4)
    case.block_table[1:, :37] = case.block_table[0, :37]
    with torch.inference_mode():
        out = run_all_rows(op, case)
    assert_matches_reference(case, out.clone())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_caches(op, dtype):
    q_lens, ctx = scenarios(16)["mixed"]
    case = make_case(q_lens, ctx, num_heads=8, num_kv_heads=2, block_size=16, dtype=dtype)
    out = run_all_rows(op, case)
    assert out.dtype == dtype
    assert_matches_reference(case, out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_caches_under_fp32_queries(op, dtype):
    """kv_cache_dtype=float16/bfloat16 with a float32 model: the kernel reads the rounded cache
    and computes in fp32, so it equals fp32 attention over the same rounded K/V."""
    q_lens, ctx = scenarios(8)["mixed"]
    case = make_case(q_lens, ctx, num_heads=9, num_kv_heads=3, head_dim=64, block_size=8)
    low = dataclasses.replace(case, k_cache=case.k_cache.to(dtype), v_cache=case.v_cache.to(dtype))
    out = run_all_rows(op, low)
    assert out.dtype == torch.float32
    rounded = dataclasses.replace(case, k_cache=low.k_cache.float(), v_cache=low.v_cache.float())
    assert_matches_reference(rounded, out)
    # and the engine-facing entry point takes the same mix (kernel rows and SDPA chunks alike)
    torch.testing.assert_close(paged_attention(*low.attention_args(), backend="cpp"), out,
                               **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_caches_on_both_sides_of_the_avx512_threshold(op, dtype):
    """A half-precision cache's rows over fewer than 128 keys take the AVX2 path even where
    AVX-512 runs (attention.cpp, kMinHalfKeys16), longer ones the AVX-512 path: one call with
    rows on both sides (and a chunk crossing it) equals fp32 attention over the rounded K/V."""
    q_lens, ctx = [1, 1, 1, 1, 4, 1], [40, 126, 127, 300, 124, 0]
    case = make_case(q_lens, ctx, num_heads=9, num_kv_heads=3, head_dim=64, block_size=8)
    low = dataclasses.replace(case, k_cache=case.k_cache.to(dtype), v_cache=case.v_cache.to(dtype))
    out = run_all_rows(op, low)
    rounded = dataclasses.replace(case, k_cache=low.k_cache.float(), v_cache=low.v_cache.float())
    assert_matches_reference(rounded, out)


@pytest.mark.parametrize("layout", ["joint", "interleaved"])
def test_cache_views_of_one_kv_tensor(op, layout):
    """kv[0] and the non-flattenable kv[:, 0] are read through their strides, in place."""
    q_lens, ctx = scenarios(8)["mixed"]
    case = make_case(q_lens, ctx, block_size=8, layout=layout)
    assert case.k_cache._base is case.v_cache._base is not None  # views of one kv tensor
    assert case.k_cache.is_contiguous() == (layout == "joint")
    assert_matches_reference(case, run_all_rows(op, case))


def test_query_view_with_row_stride(op):
    """Queries sliced out of a fused qkv projection (row stride > heads * head_dim) work."""
    case = make_case([1, 4, 1], [30, 9, 0], num_heads=8, num_kv_heads=2, block_size=8)
    fused = torch.cat([case.query, torch.full_like(case.query[:, :3], float("nan"))], dim=1)
    case.query = fused[:, :8]
    assert not case.query.is_contiguous()
    assert_matches_reference(case, run_all_rows(op, case))


def test_thread_split_is_deterministic(op):
    """Items split over threads, per row or per KV head, give bit-identical results."""
    case = make_case([1] * 12 + [9], list(range(3, 120, 10)) + [33], num_heads=9, num_kv_heads=3,
                     head_dim=64, block_size=16)  # fmt: skip
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_all_rows(op, case, heads_per_item=3, grain=10**6)
        torch.set_num_threads(2)
        outs = [run_all_rows(op, case, heads_per_item=h, grain=1) for h in (1, 2, 3)]
    finally:
        torch.set_num_threads(threads)
    for out in outs:
        torch.testing.assert_close(out, single, atol=0, rtol=0)
    assert_matches_reference(case, single)


def test_a_lone_row_splits_its_heads_into_runs_of_neighbours(op):
    """Fewer rows than two per thread: each row's KV heads go to items in runs of neighbours
    (contiguous cache memory), about two items a thread; whole rows otherwise. Any split of a
    fp16-cache row over 16 KV heads matches the reference and one item of all heads, bit for
    bit."""
    assert items_heads(1, 32, 2) == 8 and items_heads(1, 3, 2) == 1 and items_heads(3, 32, 2) == 8
    assert items_heads(4, 32, 2) == 32 and items_heads(1, 32, 1) == 16
    case = make_case([1], [70], num_heads=32, num_kv_heads=16, head_dim=64, block_size=8,
                     dtype=torch.float16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        split = run_all_rows(op, case)
        whole = run_all_rows(op, case, heads_per_item=16, grain=10**6)
    finally:
        torch.set_num_threads(threads)
    assert_matches_reference(case, split)
    torch.testing.assert_close(split, whole, atol=0, rtol=0)


def test_paged_attention_routes_decodes_and_short_chunks_to_the_kernel(op):
    """The cpp backend: kernel rows for decodes and chunks <= MAX_KERNEL_CHUNK, SDPA beyond."""
    q_lens = [1, MAX_KERNEL_CHUNK, 1, MAX_KERNEL_CHUNK + 1, 0, 5]
    ctx = [40, 3, 0, 17, 9, 16]
    case = make_case(q_lens, ctx, num_heads=6, num_kv_heads=2, head_dim=32, block_size=16)
    plan = plan_attention(case.block_table, case.seq_lens, case.cu_seqlens_q, 16)
    out = paged_attention(*case.attention_args(), backend="cpp", plan=plan)
    assert_matches_reference(case, out)
    tplan = plan._derived["cpp"]
    assert tplan.decodes == []
    assert [(c.q_start, c.q_end) for c in tplan.chunks] == [(34, 34 + MAX_KERNEL_CHUNK + 1)]
    assert tplan.kernel.rows.shape[0] == 1 + MAX_KERNEL_CHUNK + 1 + 5
    assert sorted(tplan.kernel.rows[:, 0].tolist()) == [
        t for t in range(case.query.shape[0]) if not 34 <= t < 34 + MAX_KERNEL_CHUNK + 1
    ]


def test_short_chunks_over_long_contexts_go_to_sdpa(op):
    """A chunk whose query rows x keys pass MAX_KERNEL_CHUNK_KEYS (the kernel would re-read the
    whole context once per query row) takes SDPA; decodes stay in the kernel at any length."""
    assert kernel_takes(1, 100_000) and kernel_takes(MAX_KERNEL_CHUNK, 16)
    assert not kernel_takes(MAX_KERNEL_CHUNK, MAX_KERNEL_CHUNK_KEYS // MAX_KERNEL_CHUNK + 1)
    assert not kernel_takes(MAX_KERNEL_CHUNK + 1, MAX_KERNEL_CHUNK + 1) and not kernel_takes(0, 5)
    q_lens, ctx = [1, 8, 8], [900, 2100, 10]  # 8 x 2108 keys > 16384: SDPA
    case = make_case(q_lens, ctx, num_heads=6, num_kv_heads=2, head_dim=32, block_size=16)
    plan = plan_attention(case.block_table, case.seq_lens, case.cu_seqlens_q, 16)
    out = paged_attention(*case.attention_args(), backend="cpp", plan=plan)
    assert_matches_reference(case, out)
    tplan = plan._derived["cpp"]
    assert [(c.q_start, c.q_end) for c in tplan.chunks] == [(1, 9)]
    assert sorted(tplan.kernel.rows[:, 0].tolist()) == [0, *range(9, 17)]


def test_a_step_of_decodes_and_short_chunks_fits_the_fused_layer():
    """The fused C++ layer runs a step only when the kernel takes every one of its rows."""
    plan = plan_attention(*make_case([1, 5, 1], [40, 3, 0], block_size=8).attention_args()[3:6], 8)
    assert kernel_takes_step(plan)
    long = make_case([1, MAX_KERNEL_CHUNK + 1], [40, 3], block_size=8)
    assert not kernel_takes_step(plan_attention(*long.attention_args()[3:6], 8))
