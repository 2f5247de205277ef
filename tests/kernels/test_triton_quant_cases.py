"""The Triton weight-only GEMM (w8a16 / w4a16) against dequantize-then-matmul in PyTorch.

Runs natively on CUDA, or on CPU in Triton's interpreter: tests/kernels/test_triton_quant.py
runs this file in a subprocess with ``TRITON_INTERPRET=1`` (it must be set before triton is first
imported). Shapes are small because the interpreter runs every program in Python.
"""

from __future__ import annotations

import os

import pytest
import torch

from pagedq.kernels.block_formats import dequantize, quantize_int4, quantize_int8, to_gpu_layout
from tests.quant_fixtures import INTEGER, random_weight

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not (torch.cuda.is_available() or INTERPRETING):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1; tests/kernels/test_triton_quant.py runs it "
                "in the interpreter", allow_module_level=True)
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETING else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def check(w, x: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    from pagedq.kernels.triton_quant import triton_quant_linear

    gpu = to_gpu_layout(w, DEVICE)
    out = triton_quant_linear(x.to(DEVICE), gpu, None if bias is None else bias.to(DEVICE))
    dense = dequantize(w).double()
    want = x.double() @ dense.T + (0 if bias is None else bias.double())
    err = (out.double().cpu() - want).abs().max() / want.abs().max()
    assert err < TOL[x.dtype], (w.fmt.name, tuple(x.shape), err.item())


@pytest.mark.parametrize("fmt", INTEGER)
def test_every_format_matches_dequantized_matmul(fmt):
    gen = torch.Generator().manual_seed(0)
    k = 512 if fmt.endswith("_k") else 96
    w = random_weight(fmt, 70, k, gen)
    for rows in (1, 5, 33):
        check(w, torch.randn(rows, k, generator=gen), torch.randn(70, generator=gen))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_activations(dtype):
    gen = torch.Generator().manual_seed(1)
    for w in (quantize_int8(torch.randn(40, 64, generator=gen)),
              quantize_int4(torch.randn(40, 64, generator=gen))):
        check(w, torch.randn(3, 64, generator=gen).to(dtype))


def test_layouts_pack_4_and_8_bit_codes():
    gen = torch.Generator().manual_seed(2)
    w4 = to_gpu_layout(quantize_int4(torch.randn(8, 64, generator=gen)), "cpu")
    w8 = to_gpu_layout(quantize_int8(torch.randn(8, 64, generator=gen)), "cpu")
    assert (w4.bits, w4.group, tuple(w4.data.shape)) == (4, 32, (8, 32))
    assert (w8.bits, w8.group, tuple(w8.data.shape), w8.offset) == (8, 64, (8, 64), None)


@pytest.mark.parametrize("mode", ["int8", "int4", "q8_0", "q4_0"])
def test_the_gpu_checks_cases_on_tiny_shapes(mode):
    """bench/quant_kernel_check.py's correctness case (what `python -m pagedq.bench.kernel_check` runs on
    8B-sized projections) passes its own tolerance on shapes the interpreter can afford."""
    from pagedq.bench.quant_kernel_check import TOLERANCE, check_case, make_weight

    gen = torch.Generator().manual_seed(3)
    w = make_weight(mode, 48, 128, gen)
    for rows in (1, 9):
        assert check_case(w, rows, torch.float32, DEVICE, gen) < TOLERANCE[torch.float32]
