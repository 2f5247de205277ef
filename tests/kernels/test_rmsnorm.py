"""The C++ RMSNorm (csrc/rmsnorm.cpp) against the plain PyTorch formula."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("shape", [(1, 576), (5, 64), (33, 100), (16, 7)])
def test_cpu_rms_norm_matches_torch(cpu_ops, shape):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    out = torch.empty_like(x)
    cpu_ops.rms_norm(out, x, w, 1e-6)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_non_contiguous_input_is_refused(cpu_ops):
    x = torch.randn(8, 64)[:, ::2]
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_ops.rms_norm(torch.empty(8, 32), x, torch.ones(32), 1e-6)
