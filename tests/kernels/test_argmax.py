"""The C++ greedy pick (csrc/argmax.cpp) against torch's max index: the first maximum on ties,
the first NaN where a row has one, index 0 for a row of -inf, any row length and row stride;
and the sampler's choice between the two."""

from __future__ import annotations

import pytest
import torch

from pagedq.worker.engine.sampler import greedy_argmax, torch_argmax


def pick(cpu_ops, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], dtype=torch.long)
    cpu_ops.argmax_rows(out, x)
    return out


@pytest.mark.parametrize("shape", [(1, 49152), (64, 49152), (7, 1), (5, 15), (3, 16), (9, 37)])
def test_matches_torch_max_index(cpu_ops, shape):
    g = torch.Generator().manual_seed(shape[1])
    x = torch.randn(*shape, generator=g)
    assert torch.equal(pick(cpu_ops, x), torch_argmax(x))
    # ties: the first maximum, wherever the lanes put the copies
    rows, n = shape
    for r in range(rows):
        top = x[r].max()
        for at in {n - 1, n // 2, 0}:
            x[r, at] = top
    assert torch.equal(pick(cpu_ops, x), torch_argmax(x))


def test_nan_and_minus_inf_rows(cpu_ops):
    x = torch.randn(4, 40)
    x[1, 33] = x[1, 17] = float("nan")  # the first NaN, as torch.max
    x[2] = float("-inf")  # a fully masked row
    x[3, 38] = float("inf")
    assert torch.equal(pick(cpu_ops, x), torch_argmax(x))
    assert pick(cpu_ops, x).tolist()[1:] == [17, 0, 38]


def test_rows_of_a_wider_tensor(cpu_ops):
    wide = torch.randn(6, 100)
    x = wide[:, 10:90]  # row stride 100
    assert torch.equal(pick(cpu_ops, x), torch_argmax(x))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        pick(cpu_ops, wide[:, ::2])


def test_the_sampler_takes_cpp_where_it_can(cpu_ops):
    argmax = greedy_argmax(cpu_ops)
    x = torch.randn(5, 300)
    assert torch.equal(argmax(x), torch_argmax(x))
    assert torch.equal(argmax(x.double()), torch_argmax(x.double()))  # not fp32: torch's
    assert torch.equal(argmax(x[:, ::3]), torch_argmax(x[:, ::3]))  # strided rows: torch's
    assert greedy_argmax(None) is torch_argmax
