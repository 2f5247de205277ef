"""The SDPA paged-attention backend (and the "cpp" backend it hosts) and write_kv against the
plain reference (reference.py).

Every case scatters K/V over shuffled physical blocks of a NaN-filled cache, so reading an unused
slot or a wrong block shows up as NaN or a large error. Calls without a backend run what the
process's selector picks (the C++ kernel for decodes and short chunks on an AVX2 CPU).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedq.kernels import (
    BackendUnavailableError,
    KernelArgumentError,
    paged_attention,
    plan_attention,
    reference_paged_attention,
    reference_write_kv,
    write_kv,
)
from pagedq.kernels.cases import empty_cache, make_case

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=4e-3, rtol=1e-2)}


def scenarios(bs: int) -> dict[str, tuple[list[int], list[int]]]:
    """(q_lens, context_lens) per scenario, relative to the block size."""
    return {
        "decode_on_boundary": ([1, 1, 1], [bs - 1, 2 * bs - 1, 3 * bs - 1]),
        "decode_past_boundary": ([1, 1, 1], [bs, 2 * bs, 0]),
        "decode_short_and_long": ([1, 1, 1], [bs - 2, bs, 25 * bs]),
        "decode_one_group": ([1] * 5, [3 * bs, 3 * bs + 2, 4 * bs - 2, 3 * bs + bs // 2, 4 * bs]),
        "prefill_one_block": ([bs], [0]),
        "prefill_past_boundary": ([2 * bs + 1], [0]),
        "chunk_mid_block": ([bs + 3], [bs // 2 + bs]),
        "chunk_to_boundary": ([bs // 2], [bs + bs // 2]),
        "mixed": ([5, 1, 1, bs + 3, 1, 2], [0, 3 * bs, bs - 1, 2 * bs + 2, 0, bs + 1]),
    }


def assert_matches_reference(case, out: torch.Tensor) -> None:
    ref = reference_paged_attention(*case.attention_args())
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[case.query.dtype])


@pytest.fixture(params=["sdpa", "cpp"])
def attention(request) -> str:
    """Both CPU attentions: SDPA throughout, and the C++ kernel with SDPA for long chunks."""
    if request.param == "cpp":
        request.getfixturevalue("cpu_ops")  # skips where the C++ library cannot build
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("scenario", list(scenarios(8)))
def test_matches_reference(dtype, block_size, group, scenario, attention):
    q_lens, ctx = scenarios(block_size)[scenario]
    case = make_case(
        q_lens,
        ctx,
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=32,
        block_size=block_size,
        dtype=dtype,
        seed=block_size * group,
    )
    out = paged_attention(*case.attention_args(), backend=attention)
    assert out.shape == case.query.shape and out.dtype == dtype
    assert_matches_reference(case, out)


@pytest.mark.parametrize("layout", ["joint", "interleaved"])
def test_cache_views_of_one_kv_tensor(layout, attention):
    """k_cache = kv[0] (flattenable) and kv[:, 0] (not flattenable) both work in place."""
    q_lens, ctx = scenarios(8)["mixed"]
    case = make_case(q_lens, ctx, block_size=8, layout=layout, write_new=False)
    write_kv(case.new_keys, case.new_values, case.k_cache, case.v_cache, case.slot_mapping)
    assert_matches_reference(case, paged_attention(*case.attention_args(), backend=attention))


def test_write_then_attend_matches_reference():
    """The engine's order: new tokens' slots hold NaN until write_kv fills them."""
    q_lens, ctx = scenarios(16)["mixed"]
    case = make_case(q_lens, ctx, block_size=16, write_new=False)
    assert torch.isnan(case.k_cache.view(-1, 2, 32)[case.slot_mapping]).all()
    write_kv(case.new_keys, case.new_values, case.k_cache, case.v_cache, case.slot_mapping)
    assert_matches_reference(case, paged_attention(*case.attention_args()))


@pytest.mark.parametrize("layout", ["separate", "joint", "interleaved"])
def test_write_kv_skips_padding(layout):
    k_cache, v_cache = empty_cache(6, 8, 2, 16, torch.float32, layout=layout)
    ref_k, ref_v = empty_cache(6, 8, 2, 16, torch.float32)
    slots = torch.tensor([17, -1, 3, 40, -1, 47, 0], dtype=torch.long)
    key, value = torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    write_kv(key, value, k_cache, v_cache, slots)
    reference_write_kv(key, value, ref_k, ref_v, slots)
    torch.testing.assert_close(k_cache, ref_k, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, ref_v, equal_nan=True, rtol=0, atol=0)
    assert torch.isnan(k_cache).sum() == (6 * 8 - 5) * 2 * 16


def test_plan_reused_across_layers_and_padding_rows():
    """One plan serves every layer; query rows past cu_seqlens_q[-1] come back as zeros."""
    q_lens, ctx = scenarios(8)["mixed"]
    first = make_case(q_lens, ctx, block_size=8)
    second = replace(first, query=first.query * 2, k_cache=first.k_cache * 0.5 + 1, v_cache=-first.v_cache)
    layers = [first, second]
    plan = plan_attention(first.block_table, first.seq_lens, first.cu_seqlens_q, 8)
    for case in layers:
        out = paged_attention(*case.attention_args(), plan=plan)
        assert_matches_reference(case, out)
    padded = torch.cat([first.query, torch.randn(3, *first.query.shape[1:])])
    plan = plan_attention(
        first.block_table, first.seq_lens, first.cu_seqlens_q, 8, num_tokens=padded.shape[0]
    )
    out = paged_attention(padded, *first.attention_args()[1:], plan=plan)
    assert_matches_reference(first, out[: first.query.shape[0]])
    assert (out[first.query.shape[0] :] == 0).all()


def test_decode_only_fast_path_and_zero_length_query():
    """A sequence with no new tokens (q_len 0) contributes nothing and breaks nothing."""
    case = make_case([1, 0, 1], [20, 7, 3], block_size=8)
    assert_matches_reference(case, paged_attention(*case.attention_args()))


def test_reference_equals_dense_causal_attention():
    """Sanity of the oracle itself: a pure prefill equals dense causal SDPA."""
    case = make_case([21], [0], num_heads=4, num_kv_heads=4, block_size=8)
    bt = case.block_table[0, :3].long()
    k = case.k_cache[bt].reshape(-1, 4, 32)[:21].transpose(0, 1)
    v = case.v_cache[bt].reshape(-1, 4, 32)[:21].transpose(0, 1)
    dense = F.scaled_dot_product_attention(case.query.transpose(0, 1), k, v, is_causal=True)
    ref = reference_paged_attention(*case.attention_args())
    torch.testing.assert_close(ref, dense.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_errors_tell_the_caller_what_to_do():
    case = make_case([1], [4], block_size=8)
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        paged_attention(*case.attention_args(), backend="triton")
    with pytest.raises(BackendUnavailableError, match="use one of"):
        paged_attention(*case.attention_args(), backend="cuda")
    with pytest.raises(KernelArgumentError, match="multiple of num_kv_heads"):
        paged_attention(case.query[:, :3], *case.attention_args()[1:])
    with pytest.raises(KernelArgumentError, match="share one device, and the caches"):
        paged_attention(case.query.half(), *case.attention_args()[1:])
    with pytest.raises(KernelArgumentError, match="q_len"):
        plan_attention(case.block_table, case.seq_lens - 4, case.cu_seqlens_q * 9, 8)
    with pytest.raises(KernelArgumentError, match="slot_mapping"):
        write_kv(case.new_keys, case.new_values, case.k_cache, case.v_cache, torch.zeros(3))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt_len=st.integers(1, 40),
    cuts=st.lists(st.integers(1, 39), max_size=4),
    block_size=st.sampled_from([4, 8, 16]),
    seed=st.integers(0, 1000),
)
def test_chunked_prefill_equals_whole_prefill(prompt_len, cuts, block_size, seed):
    """Writing and attending a prompt chunk by chunk gives the whole prefill's output."""
    case = make_case([prompt_len], [0], block_size=block_size, write_new=False, seed=seed)
    k_whole, v_whole = case.k_cache.clone(), case.v_cache.clone()
    write_kv(case.new_keys, case.new_values, k_whole, v_whole, case.slot_mapping)
    whole = paged_attention(case.query, k_whole, v_whole, *case.attention_args()[3:])
    bounds = sorted({0, prompt_len, *(c for c in cuts if c < prompt_len)})
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        sl = slice(start, end)
        write_kv(
            case.new_keys[sl],
            case.new_values[sl],
            case.k_cache,
            case.v_cache,
            case.slot_mapping[sl],
        )
        cu = torch.tensor([0, end - start], dtype=torch.int32)
        seq_lens = torch.tensor([end], dtype=torch.int32)
        pieces.append(
            paged_attention(case.query[sl], case.k_cache, case.v_cache, case.block_table, seq_lens, cu)
        )
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    q_lens=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    ctx=st.lists(st.integers(0, 30), min_size=4, max_size=4),
    seed=st.integers(0, 1000),
)
def test_permuting_physical_blocks_changes_nothing(q_lens, ctx, seed):
    case = make_case(q_lens, ctx[: len(q_lens)], block_size=8, seed=seed)
    out = paged_attention(*case.attention_args())
    perm = torch.randperm(case.k_cache.shape[0], generator=torch.Generator().manual_seed(seed))
    k_moved, v_moved = torch.empty_like(case.k_cache), torch.empty_like(case.v_cache)
    k_moved[perm], v_moved[perm] = case.k_cache, case.v_cache
    table = torch.where(case.block_table >= 0, perm[case.block_table.long()], -1).int()
    moved = paged_attention(case.query, k_moved, v_moved, table, case.seq_lens, case.cu_seqlens_q)
    torch.testing.assert_close(moved, out, atol=1e-6, rtol=1e-6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(
        st.tuples(st.sampled_from([1, 1, 1, 2, 5, 17]), st.integers(0, 90)), min_size=1, max_size=7
    ),
    block_size=st.sampled_from([4, 8, 16]),
    group=st.sampled_from([1, 3]),
    seed=st.integers(0, 1000),
)
def test_random_batches_match_reference(seqs, block_size, group, seed):
    """Any mix of decodes and chunks, lengths and groupings, in a NaN-filled cache."""
    q_lens, ctx = [q for q, _ in seqs], [c for _, c in seqs]
    case = make_case(q_lens, ctx, num_heads=2 * group, num_kv_heads=2, head_dim=16,
                     block_size=block_size, seed=seed)  # fmt: skip
    assert_matches_reference(case, paged_attention(*case.attention_args()))
