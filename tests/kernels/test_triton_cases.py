"""Triton paged attention and KV write against the plain reference (kernels/reference.py).

These run natively on CUDA, or on CPU in Triton's interpreter, which needs ``TRITON_INTERPRET=1``
before triton is first imported: tests/kernels/test_triton_interpreter.py runs this file in a subprocess with
that variable set, so a plain ``pytest`` on a CPU machine skips it here and runs it there.
Shapes are small because the interpreter executes every program in Python.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedq.kernels import (
    paged_attention,
    plan_attention,
    reference_paged_attention,
    reference_write_kv,
    write_kv,
)
from pagedq.kernels.cases import empty_cache, make_case

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not (torch.cuda.is_available() or INTERPRETING):
    pytest.skip(
        "needs CUDA or TRITON_INTERPRET=1; tests/kernels/test_triton_interpreter.py runs it "
        "in the interpreter",
        allow_module_level=True,
    )
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETING else "cpu"
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=4e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def scenarios(bs: int) -> dict[str, tuple[list[int], list[int]]]:
    """(q_lens, context_lens) per scenario; a reduced copy of test_torch_attention's matrix."""
    return {
        "decode_on_boundary": ([1, 1], [bs - 1, 3 * bs - 1]),
        "decode_past_boundary": ([1, 1], [2 * bs, 0]),
        "decode_short_and_long": ([1, 1, 1], [bs - 2, bs, 25 * bs]),
        "prefill_past_boundary": ([2 * bs + 1], [0]),
        "chunk_mid_block": ([bs + 3], [bs // 2 + bs]),
        "mixed": ([5, 1, bs + 3, 1], [0, 3 * bs, 2 * bs + 2, bs - 1]),
    }


def run_case(case, num_splits: int | None = None) -> torch.Tensor:
    if num_splits is None:
        return paged_attention(*case.attention_args(), backend="triton")
    from pagedq.kernels.triton_attention import triton_paged_attention

    plan = plan_attention(case.block_table, case.seq_lens, case.cu_seqlens_q, case.block_size)
    scale = case.query.shape[-1] ** -0.5
    return triton_paged_attention(case.query, case.k_cache, case.v_cache, plan, scale, num_splits=num_splits)


def assert_matches_reference(case, out: torch.Tensor) -> None:
    ref = reference_paged_attention(*case.attention_args())
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[case.query.dtype])


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("scenario", list(scenarios(8)))
def test_matches_reference_fp32(block_size, scenario):
    q_lens, ctx = scenarios(block_size)[scenario]
    group = {8: 4, 16: 1}[block_size]
    case = make_case(
        q_lens, ctx, num_heads=2 * group, num_kv_heads=2, head_dim=16,
        block_size=block_size, device=DEVICE, seed=block_size,
    )  # fmt: skip
    assert_matches_reference(case, run_case(case))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_matches_reference_half(dtype, group):
    q_lens, ctx = scenarios(16)["mixed"]
    case = make_case(
        q_lens, ctx, num_heads=group, num_kv_heads=1, head_dim=32, block_size=16,
        dtype=dtype, device=DEVICE, seed=group,
    )  # fmt: skip
    assert_matches_reference(case, run_case(case))


@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_split_kv_matches_reference(num_splits):
    """Split-KV, including splits that own no tile for short sequences (lse = -inf)."""
    case = make_case(
        [1, 1, 1], [70, 5, 33], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
        device=DEVICE,
    )  # fmt: skip
    assert_matches_reference(case, run_case(case, num_splits))


def test_split_kv_with_prefill_chunks():
    """Splits also work for query blocks whose rows see no key in some split (causal)."""
    case = make_case([9, 1], [20, 40], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, device=DEVICE)
    assert_matches_reference(case, run_case(case, num_splits=3))


@pytest.mark.parametrize("layout", ["joint", "interleaved"])
def test_write_then_attend_on_kv_views(layout):
    """write_kv + attention on kv[0] / kv[:, 0] views; new slots hold NaN until written."""
    q_lens, ctx = scenarios(8)["mixed"]
    case = make_case(
        q_lens, ctx, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, layout=layout,
        write_new=False, device=DEVICE,
    )  # fmt: skip
    write_kv(
        case.new_keys, case.new_values, case.k_cache, case.v_cache, case.slot_mapping,
        backend="triton",
    )  # fmt: skip
    assert_matches_reference(case, run_case(case))


def test_write_kv_skips_padding():
    k_cache, v_cache = empty_cache(6, 8, 2, 16, torch.float16, DEVICE, layout="interleaved")
    ref_k, ref_v = empty_cache(6, 8, 2, 16, torch.float16, DEVICE)
    slots = torch.tensor([17, -1, 3, 40, -1, 47, 0], dtype=torch.long, device=DEVICE)
    key = torch.randn(7, 2, 16, device=DEVICE, dtype=torch.float16)
    value = torch.randn(7, 2, 16, device=DEVICE, dtype=torch.float16)
    write_kv(key, value, k_cache, v_cache, slots, backend="triton")
    reference_write_kv(key, value, ref_k, ref_v, slots)
    torch.testing.assert_close(k_cache, ref_k, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, ref_v, equal_nan=True, rtol=0, atol=0)


def test_padding_rows_are_zero():
    case = make_case([3, 1], [4, 9], num_heads=2, num_kv_heads=2, head_dim=16, block_size=8,
                     device=DEVICE)  # fmt: skip
    padded = torch.cat([case.query, torch.randn_like(case.query[:2])])
    plan = plan_attention(case.block_table, case.seq_lens, case.cu_seqlens_q, 8, num_tokens=padded.shape[0])
    out = paged_attention(padded, *case.attention_args()[1:], backend="triton", plan=plan)
    assert_matches_reference(case, out[:4])
    assert (out[4:] == 0).all()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt_len=st.integers(2, 30),
    cut=st.integers(1, 29),
    block_size=st.sampled_from([4, 8, 16]),
)
def test_chunked_prefill_equals_whole_prefill(prompt_len, cut, block_size):
    cut = min(cut, prompt_len - 1)
    case = make_case([prompt_len], [0], num_heads=2, num_kv_heads=1, head_dim=16,
                     block_size=block_size, device=DEVICE)  # fmt: skip
    whole = run_case(case)
    pieces = []
    for start, end in ((0, cut), (cut, prompt_len)):
        cu = torch.tensor([0, end - start], dtype=torch.int32, device=DEVICE)
        seq_lens = torch.tensor([end], dtype=torch.int32, device=DEVICE)
        pieces.append(paged_attention(case.query[start:end], case.k_cache, case.v_cache,
                                      case.block_table, seq_lens, cu, backend="triton"))  # fmt: skip
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-5, rtol=1e-5)


def test_permuting_physical_blocks_changes_nothing():
    case = make_case([4, 1, 1], [13, 30, 2], num_heads=4, num_kv_heads=2, head_dim=16,
                     block_size=8, device=DEVICE)  # fmt: skip
    out = run_case(case)
    perm = torch.randperm(case.k_cache.shape[0], generator=torch.Generator().manual_seed(1))
    perm = perm.to(DEVICE)
    k_moved, v_moved = torch.empty_like(case.k_cache), torch.empty_like(case.v_cache)
    k_moved[perm], v_moved[perm] = case.k_cache, case.v_cache
    table = torch.where(case.block_table >= 0, perm[case.block_table.long()], -1).int()
    moved = paged_attention(case.query, k_moved, v_moved, table, case.seq_lens,
                            case.cu_seqlens_q, backend="triton")  # fmt: skip
    torch.testing.assert_close(moved, out, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_check_script_correctness_part(dtype, capsys):
    """bench/kernel_check.py's correctness checks, on tiny shapes (on CPU: in the interpreter)."""
    from pagedq.bench.kernel_check import Shape, check_attention, check_write

    shape = Shape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    cases = [("decode split", [1, 1], [40, 3], 3), ("mixed", [6, 1], [10, 20], None)]
    assert check_attention(dtype, cases, shape, device=DEVICE)
    assert check_write(dtype, shape, device=DEVICE, num_blocks=8, num_tokens=20)
    assert "FAIL" not in capsys.readouterr().out
