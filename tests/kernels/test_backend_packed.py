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
    F32_GEMV_ROWS,
    GEMV_ROWS,
    GROUPED_FORMATS,
    GROUPED_GEMV_ROWS,
    PACKED_PRECISIONS,
    PANEL_ROWS,
    PANEL_ROWS_Q6K,
    WIDE_PANEL_ROWS,
    process_selector,
)
from pagedq.kernels.block_formats import quantize_int4
from pagedq.kernels.cpu_features import ISA_LEVELS, CpuFeatures
from pagedq.kernels.cpu_ops import Isa
from pagedq.worker.config import PACKED_GEMM_PRECISIONS, EngineConfig
from pagedq.worker.models.packed import build_projection

BASE = ("avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512dq", "avx512bw")
AMX = CpuFeatures.of(*BASE, "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
VNNI_NO_BF16 = CpuFeatures.of(*BASE, "avx512_vnni")
ZEN4 = CpuFeatures.of(*BASE, "avx512_vnni", "avx512_bf16")  # AVX-512 BF16 without AMX
AVX2 = CpuFeatures.of("avx2", "fma", "f16c")
ALDER_LAKE = CpuFeatures.of("avx2", "fma", "f16c", "avx_vnni")  # AVX-VNNI without AVX-512
SKYLAKE = CpuFeatures.of(*BASE)  # AVX-512 F/VL/DQ/BW, no VNNI
AVX512_NO_BW = CpuFeatures.of(*BASE[:-1])
ARM = CpuFeatures.of(arch="aarch64")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
BLOCK_FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "int8")


def kernels(cpu: CpuFeatures, fmt: str, rows: list[int], switches: Switches | None = None):
    backend = Selector(switches, cpu=cpu).select("cpu", F32, None, 64)
    return [backend.packed_for(fmt).kernel(r) for r in rows]


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_block_formats_take_the_vnni_gemv_then_the_bf16_gemm(cpu_ops, fmt):
    """With bf16 matmul hardware the GEMV runs small decode steps (where it is faster:
    backend.GEMV_ROWS, 8-10 rows; the grouped GEMV of the 32-element block formats 48, the
    K-quants 32-40) and the bf16 tiles everything larger."""
    limit = GROUPED_GEMV_ROWS["bf16x2"][fmt] if fmt in GROUPED_FORMATS else GEMV_ROWS[fmt]
    assert 8 <= limit <= 10 or (fmt in GROUPED_FORMATS and 32 <= limit <= 48)
    assert kernels(AMX, fmt, [1, limit, limit + 1, 256]) == (["cpp-gemv-vnni"] * 2
                                                             + ["cpp-gemm-bf16x2"] * 2)


@pytest.mark.parametrize("fmt", ["q4_1", "q6_k"])
@pytest.mark.parametrize(("level", "grouped"), [("avx512_vnni", True), ("avx512", False),
                                                ("avx2", False)])
def test_projections_group_their_rows_where_the_vnni_gemv_runs(cpu_ops, level, grouped, fmt):
    """build_projection regroups a groupable weight in place for the VNNI GEMV (the embedding
    and a tied head share the object) and leaves GGUF's rows for the AVX2 kernels; the output is
    the dequantized matmul either way, through the GEMV and the GEMM. This machine's CPU, capped
    at ``level``: the kernels really run."""
    from pagedq.kernels.block_formats import dequantize
    from tests.quant_fixtures import random_weight

    if level not in process_selector().cpu.levels:
        pytest.skip(f"this CPU (or PAGEDQ_CPU_ISA) does not run level {level}")
    gen = torch.Generator().manual_seed(3)
    k = 256 if fmt == "q6_k" else 64
    weight = random_weight(fmt, 32, k, gen)
    dense = dequantize(weight).double()
    backend = Selector(Switches(), cpu_isa=level).select("cpu", F32, None, 64)
    projection = build_projection([weight], None, backend.plan().packed, torch.device("cpu"))
    assert weight.grouped is grouped
    assert backend.packed_for(fmt).kernel(1) == ("cpp-gemv-vnni" if grouped else "cpp-gemv-avx2")
    for rows in (2, 100):  # the GEMV, then the GEMM
        x = torch.randn(rows, k, generator=gen)
        want = x.double() @ dense.T
        # the int16 activations' rounding, relative to the output's scale (as the kernel tests)
        err = (projection.forward(x).double() - want).abs().max() / want.abs().max()
        assert err < 1e-4, (level, rows, err)


def test_the_grouped_formats_are_the_groupable_ones():
    from pagedq.kernels.block_formats import GROUP_FIELDS

    assert set(GROUPED_FORMATS) == set(GROUP_FIELDS)


def test_bf16_rows_hand_over_to_the_gemm_sooner(cpu_ops):
    assert kernels(AMX, "bf16", [1, 8, 9]) == ["cpp-gemv-vnni"] * 2 + ["cpp-gemm-bf16x2"]


def test_without_amx_the_gemm_multiplies_fp32_tiles(cpu_ops):
    """torch runs bf16 tiles only with AMX: every other CPU (AVX2; AVX-512 with or without
    AVX512_BF16) takes the fp32-tile GEMM past its GEMV's measured crossover (F32_GEMV_ROWS),
    whatever precision was asked, and says why in the start-up line."""
    for cpu in (VNNI_NO_BF16, ZEN4):  # the grouped GEMV beats fp32 tiles at every row count
        assert kernels(cpu, "q4_1", [1, 64, 4096]) == ["cpp-gemv-vnni"] * 3
        for fmt, kind in (("q6_k", "grouped"), ("bf16", "vnni")):  # measured crossovers
            limit = F32_GEMV_ROWS[kind][fmt]
            assert kernels(cpu, fmt, [1, limit, limit + 1]) == ["cpp-gemv-vnni"] * 2 + ["cpp-gemm-fp32"]
    limit = F32_GEMV_ROWS["avx2"]["q8_0"]
    assert kernels(AVX2, "q8_0", [1, PANEL_ROWS - 1, PANEL_ROWS, limit, limit + 1]) == [
        "cpp-gemv-avx2"] * 2 + ["cpp-panel-avx2"] * 2 + ["cpp-gemm-fp32"]
    # Q6_K's row-at-a-time kernel is the slowest: its panel from PANEL_ROWS_Q6K rows
    assert kernels(AVX2, "q6_k", [PANEL_ROWS_Q6K - 1, PANEL_ROWS_Q6K]) == ["cpp-gemv-avx2", "cpp-panel-avx2"]
    # ... but with AVX-512BW its 1-7 rows run in 512-bit vectors (csrc/quant_gemv_bw.cpp)
    assert kernels(SKYLAKE, "q6_k", [PANEL_ROWS - 1, PANEL_ROWS]) == ["cpp-gemv-avx2", "cpp-panel-avx2"]
    # AVX-512BW without VNNI (Skylake-SP): the same GEMV, the panel 16 rows a vector from 12
    assert kernels(SKYLAKE, "q8_0", [1, PANEL_ROWS, WIDE_PANEL_ROWS - 1, WIDE_PANEL_ROWS, limit,
                                     limit + 1]) == (["cpp-gemv-avx2"] + ["cpp-panel-avx2"] * 2
                                                     + ["cpp-panel-avx512"] * 2 + ["cpp-gemm-fp32"])
    assert kernels(AVX512_NO_BW, "q8_0", [WIDE_PANEL_ROWS]) == ["cpp-panel-avx2"]
    # AVX-VNNI without AVX-512 (Intel Core from Alder Lake on): the panel on vpdpwssd, AVX2's
    # row-at-a-time GEMV and crossovers
    assert kernels(ALDER_LAKE, "q8_0", [1, PANEL_ROWS, limit, limit + 1]) == (
        ["cpp-gemv-avx2"] + ["cpp-panel-avx2-vnni"] * 2 + ["cpp-gemm-fp32"])
    assert Selector(cpu=ALDER_LAKE).packed_isa() == int(Isa.AVX2_VNNI)
    # a Zen 4 or a Sapphire Rapids keeps its grouped VNNI GEMV, AVX-VNNI or not
    assert Selector(cpu=CpuFeatures.of(*AMX.flags, "avx_vnni")).packed_isa() == int(Isa.AVX512_VNNI)
    assert F32_GEMV_ROWS["avx2"].keys() == set(GEMV_ROWS) - {"float32"}
    backend = Selector(cpu=AVX2).select("cpu", F32, None, 64, packed_precision="bf16x3")
    assert "fp32 tiles, not bf16x3 (no AMX at level avx2" in " ".join(backend.reasons)


@pytest.mark.parametrize("level", ISA_LEVELS)
def test_each_level_routes_only_kernels_it_runs(cpu_ops, level):
    """This machine capped at each level it runs: every packed route and GEMM precision is one
    that level's CPU runs, and a projection through it computes (the kernels take the call)."""
    from pagedq.kernels.block_formats import dequantize
    from tests.quant_fixtures import random_weight

    if level not in process_selector().cpu.levels:
        pytest.skip(f"this CPU (or PAGEDQ_CPU_ISA) does not run level {level}: it runs "
                    f"{', '.join(process_selector().cpu.levels)}")
    backend = Selector(Switches(), cpu_isa=level).select("cpu", F32, None, 64)
    assert backend.cpu.level == level
    for choice in backend.packed:
        if choice.weight_format != "float32":
            assert ("vnni" in choice.kernel(1)) == (level in ("avx512_vnni", "amx"))
        assert choice.precision in (PACKED_PRECISIONS if level == "amx" else ("fp32",))
    gen = torch.Generator().manual_seed(8)
    weight = random_weight("q4_k", 32, 256, gen)
    projection = build_projection([weight], None, backend.plan().packed, torch.device("cpu"))
    # 40 rows: the GEMV (at the AVX2 levels the panel, on vpdpwssd at avx2_vnni); 300 rows: past
    # the AVX2 panel's 256 (the grouped VNNI GEMV takes every count), the GEMM: at amx its
    # default bf16x2 multiplies the bf16-rounded weights by the fp32 activations
    # (docs/quantization.md), elsewhere fp32 tiles the weights as they are
    for rows in (40, 300):
        x = torch.randn(rows, 256, generator=gen)
        dense = dequantize(weight)
        if backend.packed_for("q4_k").kernel(rows) == "cpp-gemm-bf16x2":
            dense = dense.bfloat16()
        want = x.double() @ dense.double().T
        err = (projection.forward(x).double() - want).abs().max() / want.abs().max()
        assert err < 1e-4, (level, rows, err)


def test_the_gemm_runs_in_the_precision_asked_for(cpu_ops):
    """The engine's packed_gemm_precision reaches each choice, its name and the QuantLinear the
    model builds from it; the GEMV is the same in both."""
    for precision in ("bf16", "bf16x2", "bf16x3"):
        backend = Selector(cpu=AMX).select("cpu", F32, None, 64, packed_precision=precision)
        limit = GROUPED_GEMV_ROWS[precision]["q4_1"]  # q4_1 is read grouped on VNNI
        assert [backend.packed_for("q4_1").kernel(r) for r in (limit, limit + 1)] == [
            "cpp-gemv-vnni", f"cpp-gemm-{precision}"]
        assert re.search(rf"\+cpp-gemm-{precision}(,|$)", backend.summary()["packed"])
        assert f"GEMM on {precision} tiles" in " ".join(backend.reasons)
        # this machine: the precision asked for where it has AMX, fp32 tiles elsewhere
        real = Selector(Switches()).select("cpu", F32, None, 64, packed_precision=precision)
        weight = quantize_int4(torch.randn(8, 64))
        projection = build_projection([weight], None, real.plan().packed, torch.device("cpu"))
        want = precision if cpu_ops.bf16_tiles else "fp32"
        assert projection.precision == int(PACKED_PRECISIONS[want])
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


@pytest.mark.parametrize(("cpu", "kind"), [(ZEN4, "grouped"), (AVX2, "avx2")])
def test_int8_activations_route_the_formats_that_have_an_int8_gemv(cpu_ops, cpu, kind):
    """--packed-activations int8: the formats with an int8 kernel at this level take it (named
    "-int8", with INT8_ACTS_BIT in QuantLinear's precision and F32_GEMV_ROWS_INT8's crossover);
    the others keep int16 and their own crossover; int16 (the default) sets no bit."""
    from pagedq.kernels.backend import BYTE_PANEL_FORMATS, F32_GEMV_ROWS_INT8, INT8_FORMATS
    from pagedq.kernels.cpu_ops import INT8_ACTS_BIT

    int8 = Selector(cpu=cpu).select("cpu", F32, None, 64, packed_activations="int8")
    int16 = Selector(cpu=cpu).select("cpu", F32, None, 64)
    gemv = "cpp-gemv-vnni" if kind == "grouped" else "cpp-gemv-avx2"
    for fmt in BLOCK_FORMATS:
        choice, plain = int8.packed_for(fmt), int16.packed_for(fmt)
        assert not plain.int8_acts and plain.precision_code & INT8_ACTS_BIT == 0
        if fmt in INT8_FORMATS[kind]:
            assert choice.int8_acts and choice.precision_code & INT8_ACTS_BIT
            assert choice.gemv_rows == F32_GEMV_ROWS_INT8.get(kind, F32_GEMV_ROWS[kind])[fmt]
            assert choice.kernel(1) == gemv + "-int8"
            if kind == "avx2":  # from PANEL_ROWS a panel: the byte one for unsigned codes
                assert plain.kernel(PANEL_ROWS) == "cpp-panel-avx2"
                assert choice.kernel(PANEL_ROWS) == ("cpp-panel-avx2-int8" if fmt in BYTE_PANEL_FORMATS
                                                     else "cpp-panel-avx2")
        else:
            assert choice == plain, fmt
    if kind == "avx2":  # at avx512 the K-quants' few rows keep their 512-bit int16 kernels
        wide = Selector(cpu=SKYLAKE).select("cpu", F32, None, 64, packed_activations="int8")
        assert [wide.packed_for(f).kernel(3) for f in ("q4_1", "q4_k", "q6_k")] == [
            "cpp-gemv-avx2-int8", "cpp-gemv-avx2", "cpp-gemv-avx2"]
        # ... and from PANEL_ROWS the byte panel at every row count (the 512-bit int16 panel
        # only for Q8_0, whose codes are signed)
        for fmt in ("q4_1", "q4_k", "q6_k", "q8_0"):
            names = {wide.packed_for(fmt).kernel(r) for r in (PANEL_ROWS, WIDE_PANEL_ROWS, 64)}
            assert names == ({"cpp-panel-avx2-int8"} if fmt in BYTE_PANEL_FORMATS
                             else {"cpp-panel-avx2", "cpp-panel-avx512"}), fmt
        # Q6_K's 5-7 rows at avx2 take its int16 panel (the byte panel starts at PANEL_ROWS)
        assert int8.packed_for("q6_k").kernel(PANEL_ROWS_Q6K) == "cpp-panel-avx2"
    with pytest.raises(ValueError, match="packed_activations must be one of"):
        Selector(cpu=cpu).select("cpu", F32, None, 64, packed_activations="int4")
    with pytest.raises(ValueError, match="packed_activations"):
        EngineConfig(packed_activations="int4")
