"""The skinny GEMV (csrc/gemv.cpp) and the LinearChoice that routes to it, against F.linear.

Both instruction-set paths run here when the CPU has them: the AVX-512 tiles and the AVX2 tiles
every x86-64 CPU the kernels support runs. K=200 has a tail past the vector loop and N=77 a ragged
last column tile; 576 x 1536 is a real model's projection (threads split it, the prefetch runs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedq.kernels.backend import LinearChoice, Selector, Switches, process_cpu
from pagedq.kernels.cpu_features import CpuFeatures
from pagedq.kernels.cpu_ops import SKINNY_MAX_ROWS, Isa

AVX2_CPU = CpuFeatures.of("avx2", "fma", "f16c")
ISAS = [Isa.AVX2, Isa.AVX512]


def needs(isa: Isa) -> None:
    if isa == Isa.AVX512 and not process_cpu().has_avx512:
        pytest.skip("this CPU has no AVX-512F/VL/DQ")


def operands(rows: int, n: int, k: int, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    return x, w, torch.randn(n, generator=g) if bias else None


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13, 16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name)
def test_skinny_linear_matches_torch(cpu_ops, rows, bias, isa):
    needs(isa)
    x, w, b = operands(rows, 77, 200, bias, rows)
    out = torch.empty(rows, 77)
    cpu_ops.skinny_linear(out, x, w, b, int(isa))
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    if rows == 16:
        with pytest.raises(RuntimeError, match="1 to 16 rows"):
            cpu_ops.skinny_linear(torch.empty(17, 77), torch.randn(17, 200), w, b, int(isa))


@pytest.mark.parametrize("rows", [1, 4, 9, 16])
@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name)
def test_skinny_linear_on_a_model_sized_projection(cpu_ops, rows, isa):
    needs(isa)
    x, w, b = operands(rows, 1536, 576, True, 100 + rows)
    out = torch.empty(rows, 1536)
    cpu_ops.skinny_linear(out, x, w, b, int(isa))
    torch.testing.assert_close(out, F.linear(x, w, b), atol=2e-4, rtol=1e-5)


def test_an_isa_the_call_cannot_run_is_refused(cpu_ops):
    x, w, _ = operands(8, 16, 32, False, 0)
    with pytest.raises(RuntimeError, match="is not one this CPU runs"):
        cpu_ops.skinny_linear(torch.empty(8, 16), x, w, None, 7)


@pytest.mark.parametrize("cpu", [None, AVX2_CPU], ids=["this-cpu", "avx2-cpu"])
@pytest.mark.parametrize("onednn", [True, False])
def test_linear_choice_routes_by_row_count(cpu_ops, cpu, onednn):
    """The model's linear for CPU fp32 weights: the GEMV up to 16 rows, then oneDNN's prepacked
    weights (or F.linear with PAGEDQ_ONEDNN=0); every route equals F.linear."""
    choice = Selector(Switches(onednn=onednn), cpu=cpu).select("cpu").linear_for("float32")
    isa = "avx512" if (cpu or process_cpu()).has_avx512 else "avx2"
    batched = "onednn" if onednn and torch.backends.mkldnn.is_available() else "torch"
    assert choice.kernel(1) == choice.kernel(SKINNY_MAX_ROWS) == f"cpp-skinny-{isa}"
    assert choice.kernel(SKINNY_MAX_ROWS + 1) == batched
    _, w, b = operands(1, 96, 200, True, 1)
    packed = choice.prepack(w)
    assert (packed is not None) == (batched == "onednn")
    for rows in (1, 5, 16, 17, 40):
        x = operands(rows, 96, 200, False, rows)[0]
        torch.testing.assert_close(choice(x, w, b, packed), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_a_format_without_a_choice_runs_f_linear():
    """A weight format the backend has no kernel for still computes, with torch."""
    backend = Selector(Switches(cpu_kernels=False)).select("cpu")
    choice = backend.linear_for("int8")
    assert choice == LinearChoice("int8", "torch") and choice.kernel(1) == "torch"
    x, w, b = operands(3, 10, 20, True, 0)
    torch.testing.assert_close(choice(x, w, b), F.linear(x, w, b))
