"""The selector's choices for packed weights (kernels/backend.py): which kernel runs a packed
projection for each CPU, row count and device, and which dtype a model's activations take.

Machines are described with CpuFeatures.of(...), as in test_backend.py; the rows that choose the
C++ kernels need them to build here (the ``cpu_ops`` fixture skips, saying why, elsewhere).
"""

from __future__ import annotations

import re

import pytest
import torch

from pagedq.kernels import Selector, Switches
from pagedq.kernels.backend import (
    DEFAULT_PACKED_PRECISION,
    GEMV_ROWS,
    GROUPED_FORMATS,
    GROUPED_GEMV_ROWS,
    PACKED_PRECISIONS,
)
from pagedq.kernels.cpu_features import CpuFeatures, detect_cpu_features
from pagedq.worker.config import PACKED_GEMM_PRECISIONS, EngineConfig
from pagedq.worker.models.packed import build_projection
from pagedq.worker.models.quant import quantize_int4

BASE = ("avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512dq", "avx512bw")
AMX = CpuFeatures.of(*BASE, "avx512_vnni", "amx_bf16", "amx_int8")
VNNI_NO_BF16 = CpuFeatures.of(*BASE, "avx512_vnni")
AVX2 = CpuFeatures.of("avx2", "fma", "f16c")
ARM = CpuFeatures.of(arch="aarch64")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
BLOCK_FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "int8")


def kernels(cpu: CpuFeatures, fmt: str, rows: list[int], switches: Switches | None = None):
    backend = Selector(switches, cpu=cpu).select("cpu", F32, None, 64)
    return [backend.packed_for(fmt).kernel(r) for r in rows]


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_block_formats_take_the_vnni_gemv_then_the_bf16_gemm(cpu_ops, fmt):
    """With bf16 matmul hardware the GEMV runs small decode steps (where it is faster:
    backend.GEMV_ROWS, 8-10 rows; the grouped GEMV of the 32-element block formats and Q4_K 32) and the
    bf16 tiles everything larger."""
    limit = GROUPED_GEMV_ROWS["bf16x2"] if fmt in GROUPED_FORMATS else GEMV_ROWS[fmt]
    assert 8 <= limit <= 10 or (fmt in GROUPED_FORMATS and limit == 32)
    assert kernels(AMX, fmt, [1, limit, limit + 1, 256]) == (["cpp-gemv-vnni"] * 2
                                                             + ["cpp-gemm-bf16x2"] * 2)


def test_projections_group_their_rows_where_the_vnni_gemv_runs(cpu_ops):
    """build_projection regroups a groupable weight in place for the VNNI GEMV (the embedding
    and a tied head share the object) and leaves GGUF's rows for the AVX2 kernels; the output is
    the dequantized matmul either way."""
    from pagedq.worker.models.quant import dequantize
    from tests.quant_fixtures import random_weight

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, generator=gen)
    for cpu, grouped in ((AMX, True), (AVX2, False)):
        if grouped and not detect_cpu_features().has_avx512_vnni:
            continue  # the VNNI kernels cannot run here
        weight = random_weight("q4_1", 32, 64, gen)
        want = x.double() @ dequantize(weight).double().T
        backend = Selector(cpu=cpu).select("cpu", F32, None, 64)
        projection = build_projection([weight], None, backend, torch.device("cpu"))
        assert weight.grouped is grouped
        # the int16 activations' rounding, relative to the output's scale (as the kernel tests)
        err = (projection.forward(x).double() - want).abs().max() / want.abs().max()
        assert err < 1e-4, (cpu, err)


def test_the_grouped_formats_are_the_groupable_ones():
    from pagedq.worker.models.quant import GROUP_FIELDS

    assert set(GROUPED_FORMATS) == set(GROUP_FIELDS)


def test_bf16_rows_hand_over_to_the_gemm_sooner(cpu_ops):
    assert kernels(AMX, "bf16", [1, 8, 9]) == ["cpp-gemv-vnni"] * 2 + ["cpp-gemm-bf16x2"]


def test_without_bf16_hardware_the_gemv_keeps_more_rows(cpu_ops):
    """bf16 tiles multiply slowly without AMX/AVX512_BF16, so the integer GEMV keeps 64 rows."""
    assert kernels(VNNI_NO_BF16, "q4_1", [1, 64, 65]) == ["cpp-gemv-vnni"] * 2 + ["cpp-gemm-bf16x2"]
    assert kernels(AVX2, "q8_0", [1, 64, 65]) == ["cpp-gemv-avx2"] * 2 + ["cpp-gemm-bf16x2"]


def test_the_gemm_runs_in_the_precision_asked_for(cpu_ops):
    """The engine's packed_gemm_precision reaches each choice, its name and the QuantLinear the
    model builds from it; the GEMV is the same in both."""
    for precision in ("bf16", "bf16x2", "bf16x3"):
        backend = Selector(cpu=AMX).select("cpu", F32, None, 64, packed_precision=precision)
        limit = GROUPED_GEMV_ROWS[precision]  # q4_1 is read grouped on VNNI
        assert [backend.packed_for("q4_1").kernel(r) for r in (limit, limit + 1)] == [
            "cpp-gemv-vnni", f"cpp-gemm-{precision}"]
        assert re.search(rf"\+cpp-gemm-{precision}(,|$)", backend.summary()["packed"])
        assert "products" in " ".join(backend.reasons) and precision in " ".join(backend.reasons)
        weight = quantize_int4(torch.randn(8, 64))
        projection = build_projection([weight], None, backend, torch.device("cpu"))
        assert projection.precision == int(PACKED_PRECISIONS[precision])
    with pytest.raises(ValueError, match="packed_precision"):
        Selector(cpu=AMX).select("cpu", F32, None, 64, packed_precision="fp8")


def test_the_engine_config_names_the_selectors_precisions():
    """EngineConfig (no torch import) repeats the selector's names and default: keep them equal."""
    assert set(PACKED_GEMM_PRECISIONS) == set(PACKED_PRECISIONS)
    assert EngineConfig(model="m").packed_gemm_precision == DEFAULT_PACKED_PRECISION


def test_without_the_cpp_kernels_packed_weights_are_dequantized_per_call():
    assert kernels(AMX, "q4_k", [1, 64], Switches(cpu_kernels=False)) == ["torch-dequant"] * 2
    assert kernels(ARM, "int8", [1]) == ["torch-dequant"]


def test_cuda_takes_the_triton_weight_only_gemm():
    backend = Selector(cpu=AMX, has_triton=True).select("cuda", BF16)
    assert {backend.packed_for(f).name for f in BLOCK_FORMATS} == {"triton-wq"}
    without = Selector(cpu=AMX, has_triton=False).select("cuda", BF16)
    assert without.packed_for("q4_0").name == "torch-dequant"


def test_the_start_up_line_names_each_packed_route(cpu_ops):
    summary = Selector(cpu=AMX).select("cpu", F32, None, 64).summary()["packed"]
    assert "q4_1" in summary and "cpp-gemv-vnni<=10+cpp-gemm-bf16x2" in summary
    assert "bf16: cpp-gemv-vnni<=8+cpp-gemm-bf16x2" in summary


@pytest.mark.parametrize(("cpu", "dtype", "packed", "want"), [
    (AMX, F32, False, F32),
    (AMX, F32, True, F32),
    (AMX, BF16, False, F32),  # bf16 rows through the C++ kernels: the bf16 fast path
    (AMX, BF16, True, F32),
    (AMX, F16, False, F16),  # no fp16 route: the model computes as asked
    (AMX, F16, True, F32),
    (VNNI_NO_BF16, BF16, False, BF16),  # no bf16 hardware: rows would gain nothing
    (VNNI_NO_BF16, BF16, True, F32),
    (ARM, BF16, True, BF16),  # no C++ kernels: dequantize per call in the model's dtype
])
def test_compute_dtype(cpu_ops, cpu, dtype, packed, want):
    assert Selector(cpu=cpu).compute_dtype("cpu", dtype, packed=packed) == want


def test_accelerators_compute_in_the_models_dtype():
    assert Selector(cpu=AMX, has_triton=True).compute_dtype("cuda", BF16, packed=True) == BF16
    off = Selector(Switches(cpu_kernels=False), cpu=AMX)
    assert off.compute_dtype("cpu", BF16, packed=True) == BF16
