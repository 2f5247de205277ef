"""The packed-weight CPU kernels against dequantize-then-matmul in plain PyTorch (float64).

quant_gemv (AVX-512 VNNI and AVX2 alike) rounds the activations to int16 per 32 values, so its
oracle applies that same rounding in PyTorch first and must then agree to float rounding.
quant_gemm in precision bf16x3 multiplies bf16 heads
and tails of both operands with fp32 accumulation: its oracle is the exact product, to ~1e-5. In
precision bf16 it rounds each operand once to bf16 (nearest even): its oracle is the product of
the bf16-rounded operands in float64, to fp32 accumulation, and the exact product only to bf16's
~1e-2. Those three multiply bf16 tiles, which torch runs only with AMX: elsewhere they are
skipped, saying so. Precision fp32 (every CPU) multiplies fp32 tiles: its oracle is the exact
product, to fp32 accumulation. Every path this process's CPU can run is tested (AVX-512 VNNI and
the AVX2 path); tests/kernels/test_isa_levels.py runs this file again at every lower level.
"""

from __future__ import annotations

import pytest
import torch

from pagedq.kernels.backend import GROUPED_FORMATS, process_selector
from pagedq.kernels.block_formats import FORMATS, GROUPED, QuantWeight, dequantize, quantize_int4
from pagedq.kernels.cpu_ops import INT8_ACTS_BIT, GemmPrecision, Isa
from tests.quant_fixtures import ALL, random_weight

CPU = process_selector().cpu  # this CPU, capped at PAGEDQ_CPU_ISA where that is set


@pytest.fixture(params=[Isa.AVX512_VNNI, Isa.AVX512, Isa.AVX2_VNNI, Isa.AVX2], ids=lambda i: i.name)
def isa(request) -> int:
    """Every packed path: the VNNI kernels; AVX2's with the many-row panel in AVX-512BW (isa
    AVX512: 16 rows a vector, csrc/panel_gemv512.cpp; also where VNNI is present, so a VNNI
    machine tests what a Skylake-SP runs); AVX2's with the panel on AVX-VNNI's vpdpwssd (isa
    AVX2_VNNI, csrc/panel_gemv_vnni.cpp); AVX2's own."""
    if request.param == Isa.AVX512_VNNI and not CPU.has_avx512_vnni:
        pytest.skip(f"no AVX-512 VNNI at this process's level ({CPU.level})")
    if request.param == Isa.AVX512 and not (CPU.has_avx512 and "avx512bw" in CPU.flags):
        pytest.skip(f"no AVX-512 F/VL/DQ/BW at this process's level ({CPU.level})")
    if request.param == Isa.AVX2_VNNI and not CPU.has_avx_vnni:
        pytest.skip(f"no AVX-VNNI at this process's level ({CPU.level})")
    return int(request.param)


BEST = int(Isa.AVX512_VNNI if CPU.has_avx512_vnni else Isa.AVX2)
TILE_PRECISIONS = (GemmPrecision.BF16X3, GemmPrecision.BF16, GemmPrecision.BF16X2)


def need_tiles(cpu_ops, precision: int) -> None:
    """Skip a bf16-tile precision where torch cannot run bf16 tiles (no AMX)."""
    if precision in TILE_PRECISIONS and not cpu_ops.bf16_tiles:
        pytest.skip(f"precision {GemmPrecision(precision).name} multiplies bf16 tiles, which torch "
                    f"runs only with AMX (level here: {CPU.level})")


def quantized_activations(x: torch.Tensor, isa: int) -> torch.Tensor:
    """x as the GEMV sees it (the same rule on every ``isa``): each run of 32 values rounded to
    int16 steps of max|x| / 32767."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # torch.full_like(...) / amax, not 32767 / amax: the latter is reciprocal() * 32767, one ulp
    # off the kernel's division, which flips the rounding of values that land on .5
    inv = torch.where(amax > 0, torch.full_like(amax, 32767) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 32767)).view_as(x)


def widths(fmt: str) -> tuple[int, ...]:
    """K values: an odd number of 32-blocks (a half chunk), one chunk, several super-blocks."""
    return (256, 512) if FORMATS[fmt].block == 256 else (288, 64, 512)


@pytest.mark.parametrize("rows", [5, 20, 75])
def test_output_can_be_a_column_slice(cpu_ops, isa, rows):
    """Fused projections write their parts of one output (row stride > N); from 8 rows the
    panel writes a stripe of 16 columns at a time (38 columns: two stripes and a part, the
    last quad short)."""
    gen = torch.Generator().manual_seed(5)
    w = random_weight("q8_0", 38, 64, gen)
    x = torch.randn(rows, 64, generator=gen)
    bias = torch.randn(38, generator=gen)
    gemm = lambda *a: cpu_ops.quant_gemm(*a, int(GemmPrecision.F32))  # noqa: E731
    for op in (cpu_ops.quant_gemv, gemm):
        for b in (None, bias):
            wide = torch.full((rows, 60), 7.0)
            op(wide[:, 10:48], x, w.data, w.fmt.code, None, b, isa)
            solo = torch.empty(rows, 38)
            op(solo, x, w.data, w.fmt.code, None, b, isa)
            torch.testing.assert_close(wide[:, 10:48], solo, rtol=0, atol=0)
            assert torch.all(wide[:, :10] == 7) and torch.all(wide[:, 48:] == 7)
            want = x.double() @ dequantize(w).double().T  # the GEMV rounds x to int16 steps
            assert relative_error(solo, want + (0 if b is None else b.double())) < 1e-4


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def products(op, fmt: str, n: int, row_counts: tuple[int, ...], isa: int, seed: int, *extra):
    """Run ``op`` over random ``fmt`` weights of every width and each row count (``extra``: the
    op's arguments after ``isa``); yields (k, rows, x, out, dense weight, bias) for the caller's
    comparison."""
    gen = torch.Generator().manual_seed(seed)
    for k in widths(fmt):
        w = random_weight(fmt, n, k, gen)
        dense = dequantize(w).double()
        bias = torch.randn(n, generator=gen)
        for rows in row_counts:
            x = torch.randn(rows, k, generator=gen)
            out = torch.empty(rows, n)
            op(out, x, w.data, w.fmt.code, w.scales, bias, isa, *extra)
            yield k, rows, x, out, dense, bias.double()


@pytest.mark.parametrize("fmt", ALL)
def test_gemv_matches_dequantized_matmul(cpu_ops, isa, fmt):
    for k, rows, x, out, dense, bias in products(cpu_ops.quant_gemv, fmt, 37,
                                                 (1, 3, 6, 8, 11, 17, 20, 35, 75), isa, seed=1):
        # bf16 rows meet the fp32 activations as they are; the integer formats round them
        xq = x if fmt == "bf16" else quantized_activations(x, isa)
        assert relative_error(out, xq.double() @ dense.T + bias) < 1e-5, (fmt, k, rows)
        # the int16 activation rounding itself stays far below the weights' own
        assert relative_error(out, x.double() @ dense.T + bias) < 1e-4


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k"])
def test_four_to_seven_rows_of_a_k_quant_equal_each_row_alone(cpu_ops, isa, fmt):
    """The AVX2 GEMV (and the avx512 level's 512-bit one) takes 4-7 activation rows of a K-quant
    as pieces of 2-3 rows of the row kernel: each row's output is its own one-row result, bit
    for bit (a speculative step's verification rows then equal plain decoding's)."""
    gen = torch.Generator().manual_seed(8)
    w = random_weight(fmt, 37, 512, gen)
    rows = 4 if fmt == "q6_k" else 7  # Q6_K's AVX2 panel takes 5 rows on
    x = torch.randn(rows, 512, generator=gen)
    together = torch.empty(rows, 37)
    cpu_ops.quant_gemv(together, x, w.data, w.fmt.code, None, None, isa)
    for r in range(rows):
        alone = torch.empty(1, 37)
        cpu_ops.quant_gemv(alone, x[r:r + 1], w.data, w.fmt.code, None, None, isa)
        if isa == int(Isa.AVX512_VNNI):  # the grouped GEMV's layouts differ by row count
            torch.testing.assert_close(together[r:r + 1], alone, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(together[r:r + 1], alone), (fmt, r)


@pytest.mark.parametrize("fmt", ALL)
def test_the_avx_vnni_kernels_equal_the_avx2_ones(cpu_ops, fmt):
    """The AVX2 GEMV on vpdpwssd (isa AVX2_VNNI: the one-to-seven-row kernels and the panel)
    makes the same int32 sums as vpmaddwd + vpaddd and applies the same scales in the same
    order: bit for bit at every row count (1-3 rows, the K-quants' pieces at 4-7, the panel
    from 8 to a pass of 32 and past it, a padded last group, a tail of 1-3 rows), every format,
    with a bias and into a column slice (the dequantized product, the oracle of both, is checked
    by test_gemv_matches_dequantized_matmul)."""
    if not CPU.has_avx_vnni:
        pytest.skip(f"no AVX-VNNI at this process's level ({CPU.level})")
    gen = torch.Generator().manual_seed(9)
    for k in widths(fmt):
        w = random_weight(fmt, 45, k, gen)
        for rows in (1, 2, 3, 4, 5, 7, 8, 13, 19, 32, 41, 70):
            x = torch.randn(rows, k, generator=gen)
            bias = torch.randn(45, generator=gen)
            outs = [torch.empty(rows, 60)[:, 5:50] for _ in range(2)]  # a column slice: ldo 60
            for out, isa in zip(outs, (Isa.AVX2_VNNI, Isa.AVX2), strict=True):
                cpu_ops.quant_gemv(out, x, w.data, w.fmt.code, w.scales, bias, int(isa))
            assert torch.equal(outs[0], outs[1]), (fmt, k, rows)


@pytest.mark.parametrize("fmt", ["q5_0", "q5_1", "q4_k", "q5_k", "q6_k"])
def test_avx512bw_row_kernels_equal_the_avx2_ones(cpu_ops, fmt):
    """The avx512 level's one-to-three-row kernels (csrc/quant_gemv_bw.cpp: Q5_0/Q5_1's fifth
    bits as a mask register, Q4_K, Q5_K and Q6_K in 512-bit vectors) compute the same integer sums
    and apply the same scales in the same order as the AVX2 kernels: bit for bit, every width
    and 1-3 rows (the dequantized product, the oracle of both, is checked above)."""
    if not (CPU.has_avx512 and "avx512bw" in CPU.flags):
        pytest.skip(f"no AVX-512 F/VL/DQ/BW at this process's level ({CPU.level})")
    gen = torch.Generator().manual_seed(5)
    # Q4_K and Q6_K take 4-7 rows as pieces of 2-3 on both levels (Q6_K's AVX2 panel from 5)
    most = {"q4_k": 7, "q5_k": 7, "q6_k": 4}.get(fmt, 3)
    for k in widths(fmt):
        w = random_weight(fmt, 45, k, gen)
        for rows in range(1, most + 1):
            x = torch.randn(rows, k, generator=gen)
            bias = torch.randn(45, generator=gen)
            outs = [torch.empty(rows, 60)[:, 5:50] for _ in range(2)]  # a column slice: ldo 60
            for out, isa in zip(outs, (Isa.AVX512, Isa.AVX2), strict=True):
                cpu_ops.quant_gemv(out, x, w.data, w.fmt.code, None, bias, int(isa))
            assert torch.equal(outs[0], outs[1]), (fmt, k, rows)


@pytest.mark.parametrize("fmt", ALL)
def test_gemm_matches_dequantized_matmul(cpu_ops, isa, fmt):
    need_tiles(cpu_ops, GemmPrecision.BF16X3)
    for k, rows, x, out, dense, bias in products(cpu_ops.quant_gemm, fmt, 45, (1, 17, 64, 130),
                                                 isa, 2, int(GemmPrecision.BF16X3)):
        assert relative_error(out, x.double() @ dense.T + bias) < 2e-5, (fmt, k, rows)


@pytest.mark.parametrize("fmt", ALL)
def test_fp32_gemm_matches_dequantized_matmul(cpu_ops, isa, fmt):
    """Precision fp32 (every CPU without AMX): fp32 tiles into ATen's GEMM, the exact product."""
    for k, rows, x, out, dense, bias in products(cpu_ops.quant_gemm, fmt, 45, (1, 17, 64, 130),
                                                 isa, 2, int(GemmPrecision.F32)):
        assert relative_error(out, x.double() @ dense.T + bias) < 1e-5, (fmt, k, rows)


def test_fp32_gemm_takes_many_tiles_and_rows(cpu_ops):
    """More output rows than one tile holds and more activation rows than a step's bucket."""
    gen = torch.Generator().manual_seed(21)
    w = random_weight("q4_0", 600, 1536, gen)
    x = torch.randn(300, 1536, generator=gen)
    out = torch.empty(300, 600)
    cpu_ops.quant_gemm(out, x, w.data, w.fmt.code, None, None, BEST, int(GemmPrecision.F32))
    assert relative_error(out, x.double() @ dequantize(w).double().T) < 1e-5


def rounded(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bf16 (nearest even), back in float64."""
    return t.float().bfloat16().double()


@pytest.mark.parametrize("fmt", ALL)
def test_bf16_gemm_matches_bf16_dequantized_matmul(cpu_ops, isa, fmt):
    """Precision bf16: the product of the bf16-rounded dequantized weights and activations."""
    need_tiles(cpu_ops, GemmPrecision.BF16)
    for k, rows, x, out, dense, bias in products(cpu_ops.quant_gemm, fmt, 45, (1, 17, 64, 130),
                                                 isa, 2, int(GemmPrecision.BF16)):
        assert relative_error(out, rounded(x) @ rounded(dense).T + bias) < 2e-5, (fmt, k, rows)
        # against the exact product: bf16's own rounding, and no more
        assert relative_error(out, x.double() @ dense.T + bias) < 2e-2, (fmt, k, rows)



@pytest.mark.parametrize("fmt", ALL)
def test_bf16x2_gemm_matches_rounded_weights_times_exact_activations(cpu_ops, isa, fmt):
    """Precision bf16x2: the bf16-rounded dequantized weights times the fp32 activations."""
    need_tiles(cpu_ops, GemmPrecision.BF16X2)
    for k, rows, x, out, dense, bias in products(cpu_ops.quant_gemm, fmt, 45, (1, 17, 64, 130),
                                                 isa, 2, int(GemmPrecision.BF16X2)):
        assert relative_error(out, x.double() @ rounded(dense).T + bias) < 2e-5, (fmt, k, rows)


GROUPABLE = GROUPED_FORMATS  # grouped by the engine on AVX-512 VNNI
needs_vnni = pytest.mark.skipif(not CPU.has_avx512_vnni,
                                reason=f"grouped rows run on AVX-512 VNNI only (level here: {CPU.level})")


def grouped_weight(fmt: str, n: int, k: int, gen: torch.Generator):
    """A random weight and its grouped twin (the same rows, regrouped 16 at a time)."""
    w = random_weight(fmt, n, k, gen)
    g = QuantWeight(w.fmt, w.data.clone(), w.shape)
    g.set_grouped(True)
    return w, g


def split_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the grouped GEMV sees it: each run of 32 values rounded to int16 steps of
    max|x| / 32512 (the largest code whose high byte fits in int8)."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 32512) * (1 / amax), torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 32512)).view_as(x)


@needs_vnni
@pytest.mark.parametrize("fmt", GROUPABLE)
def test_grouped_gemv_matches_dequantized_matmul(cpu_ops, fmt):
    """Grouped rows: 4 (Q8_0, Q4_K, Q5_K: 2) rows per vector, activations split into two signed
    bytes."""
    gen = torch.Generator().manual_seed(11)
    for k in (256, 1536) if FORMATS[fmt].block == 256 else (32, 96, 576):
        w, g = grouped_weight(fmt, 48, k, gen)
        dense = dequantize(w).double()
        bias = torch.randn(48, generator=gen)
        for rows in (1, 3, 8, 9):
            x = torch.randn(rows, k, generator=gen)
            out = torch.empty(rows, 48)
            cpu_ops.quant_gemv(out, x, g.data, g.kernel_code, None, bias, BEST)
            want = split_activations(x).double() @ dense.T + bias.double()
            assert relative_error(out, want) < 1e-5, (fmt, k, rows)
            assert relative_error(out, x.double() @ dense.T + bias.double()) < 1e-4


@needs_vnni
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q4_k", "q6_k"])
def test_grouped_gemv_in_chunks_equals_one_pass_a_row_group(cpu_ops, fmt):
    """Many rows (several passes of 8) over a matrix far past the 128 KiB chunks a thread takes
    at a time (group_gemv.cpp: all_rows): bit for bit the rows computed 8 at a time (one pass,
    no chunks), and close to the dequantized product."""
    gen = torch.Generator().manual_seed(17)
    n, k = 1024, 512  # Q8_0: 557 KB, Q4_1: 328 KB
    w, g = grouped_weight(fmt, n, k, gen)
    x = torch.randn(19, k, generator=gen)
    out = torch.empty(19, n)
    cpu_ops.quant_gemv(out, x, g.data, g.kernel_code, None, None, BEST)
    for r in range(0, 19, 8):
        piece = torch.empty(min(8, 19 - r), n)
        cpu_ops.quant_gemv(piece, x[r:r + 8].contiguous(), g.data, g.kernel_code, None, None, BEST)
        torch.testing.assert_close(out[r:r + 8], piece, rtol=0, atol=0)
    want = split_activations(x).double() @ dequantize(w).double().T
    assert relative_error(out, want) < 1e-5


@needs_vnni
@pytest.mark.parametrize("int8_acts", [False, True], ids=["int16", "int8"])
def test_grouped_segments_run_as_one_gemv(cpu_ops, int8_acts):
    """A QuantLinear whose segments are all grouped (q, k and v in Q4_1, Q8_0 and Q4_K; Q6_K's
    activation sums beside) runs them in one region over one activation split: bit for bit each
    segment's own grouped GEMV."""
    gen = torch.Generator().manual_seed(13)
    k = 256
    parts = [grouped_weight(f, n, k, gen)[1]
             for f, n in (("q4_1", 48), ("q8_0", 32), ("q4_k", 16), ("q6_k", 16))]
    bias = torch.randn(112, generator=gen)
    precision = int(GemmPrecision.F32) | (INT8_ACTS_BIT if int8_acts else 0)
    acts = 8 if int8_acts else 16
    linear = cpu_ops.quant_linear([p.data for p in parts], [p.kernel_code for p in parts],
                                  [None] * 4, bias, k, [16] * 4, BEST, precision)
    for rows in (1, 3, 9, 16):
        x = torch.randn(rows, k, generator=gen)
        want = torch.empty(rows, 112)
        col = 0
        for part in parts:
            n = part.shape[0]
            piece = want[:, col:col + n]
            cpu_ops.quant_gemv(piece, x, part.data, part.kernel_code, None,
                               bias[col:col + n], BEST, acts)
            col += n
        torch.testing.assert_close(linear.forward(x), want, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 3, 9, 20])
def test_fused_segments_split_over_two_threads_by_bytes(cpu_ops, rows):
    """Two threads share a fused projection by its weights' bytes (csrc/quant_formats.h,
    parallel_parts): Q4_K q (576-byte rows) beside Q6_K v (840), large enough for two tasks,
    whose byte halves meet inside q. Every output column is computed, once: each equals the
    segment's own GEMV bit for bit (the row and panel kernels; at VNNI the grouped one), and
    the segments' own GEMVs match the dequantized product (test_gemv_matches_dequantized_matmul)."""
    gen = torch.Generator().manual_seed(23)
    k = 1024
    parts = [random_weight(f, n, k, gen) for f, n in (("q4_k", 512), ("q6_k", 256))]
    if BEST == int(Isa.AVX512_VNNI):
        for part in parts:
            part.set_grouped(True)
    total = sum(p.shape[0] for p in parts)
    x = torch.randn(rows, k, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        linear = cpu_ops.quant_linear([p.data for p in parts], [p.kernel_code for p in parts],
                                      [p.scales for p in parts], None, k, [64] * len(parts), BEST,
                                      int(GemmPrecision.F32))
        got = linear.forward(x)
        want = torch.full((rows, total), float("nan"))
        col = 0
        for part in parts:
            n = part.shape[0]
            cpu_ops.quant_gemv(want[:, col:col + n], x, part.data, part.kernel_code, part.scales,
                               None, BEST)
            col += n
    finally:
        torch.set_num_threads(threads)
    assert not want.isnan().any()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("isa", [Isa.AVX2, Isa.AVX512], ids=lambda i: i.name)
def test_segments_run_as_one_avx2_gemv(cpu_ops, isa):
    """Below VNNI a QuantLinear whose segments all take the GEMV (GGUF rows of several formats,
    int8 rows with their scales) runs them in one region over one activation quantization: bit
    for bit each segment's own GEMV, and the GEMM above a segment's limit as before."""
    if isa == Isa.AVX512 and not CPU.has_avx512:
        pytest.skip(f"no AVX-512 at this process's level ({CPU.level})")
    gen = torch.Generator().manual_seed(14)
    k = 256
    parts = [random_weight(f, n, k, gen)
             for f, n in (("q4_1", 37), ("q8_0", 19), ("q4_k", 8), ("q6_k", 5), ("int8", 11))]
    total = sum(p.shape[0] for p in parts)
    bias = torch.randn(total, generator=gen)
    linear = cpu_ops.quant_linear([p.data for p in parts], [p.fmt.code for p in parts],
                                  [p.scales for p in parts], bias, k, [16] * len(parts), int(isa),
                                  int(GemmPrecision.F32))
    for rows in (1, 3, 9, 16, 17):
        x = torch.randn(rows, k, generator=gen)
        want = torch.empty(rows, total)
        col = 0
        for part in parts:
            n = part.shape[0]
            piece = want[:, col:col + n]
            if rows <= 16:
                cpu_ops.quant_gemv(piece, x, part.data, part.fmt.code, part.scales,
                                   bias[col:col + n], int(isa))
            else:
                cpu_ops.quant_gemm(piece, x, part.data, part.fmt.code, part.scales,
                                   bias[col:col + n], int(isa), int(GemmPrecision.F32))
            col += n
        torch.testing.assert_close(linear.forward(x), want, rtol=0, atol=0)


@needs_vnni
@pytest.mark.parametrize("fmt", GROUPABLE)
@pytest.mark.parametrize("precision", list(GemmPrecision), ids=lambda p: p.name)
def test_grouped_gemm_equals_plain_rows(cpu_ops, fmt, precision):
    """The GEMM's tile decoder reads a grouped row's blocks where they are: same bits out."""
    need_tiles(cpu_ops, precision)
    gen = torch.Generator().manual_seed(12)
    k = 256 if FORMATS[fmt].block == 256 else 96
    w, g = grouped_weight(fmt, 64, k, gen)
    x = torch.randn(70, k, generator=gen)
    plain, grouped = torch.empty(70, 64), torch.empty(70, 64)
    cpu_ops.quant_gemm(plain, x, w.data, w.fmt.code, None, None, BEST, int(precision))
    cpu_ops.quant_gemm(grouped, x, g.data, g.kernel_code, None, None, BEST, int(precision))
    torch.testing.assert_close(grouped, plain, rtol=0, atol=0)


def test_grouping_is_checked(cpu_ops):
    gen = torch.Generator().manual_seed(13)
    w = random_weight("int8", 16, 256, gen)
    with pytest.raises(RuntimeError, match="can be grouped"):
        cpu_ops.quant_gemv(torch.empty(1, 16), torch.randn(1, 256), w.data,
                           w.fmt.code | GROUPED, None, None, BEST)
    w = random_weight("q8_0", 24, 64, gen)  # not a whole number of groups
    with pytest.raises(RuntimeError, match="16 rows at a time"):
        cpu_ops.quant_gemv(torch.empty(1, 24), torch.randn(1, 64), w.data,
                           w.fmt.code | GROUPED, None, None, BEST)
    _, g = grouped_weight("q8_0", 16, 64, gen)
    with pytest.raises(RuntimeError, match="VNNI"):
        cpu_ops.quant_gemv(torch.empty(1, 16), torch.randn(1, 64), g.data, g.kernel_code, None,
                           None, int(Isa.AVX2))


def test_gemm_precision_is_checked(cpu_ops):
    w = random_weight("q8_0", 8, 64, torch.Generator().manual_seed(7))
    with pytest.raises(RuntimeError, match="precision"):
        cpu_ops.quant_gemm(torch.empty(2, 8), torch.randn(2, 64), w.data, w.fmt.code, None, None,
                           BEST, 7)


def test_bf16_tiles_without_amx_are_a_clear_error(cpu_ops):
    """Where torch cannot run bf16 tiles, asking for them names the fix (not oneDNN's words)."""
    if cpu_ops.bf16_tiles:
        pytest.skip("this CPU runs bf16 tiles (AMX)")
    w = random_weight("q8_0", 8, 64, torch.Generator().manual_seed(7))
    for precision in TILE_PRECISIONS:
        with pytest.raises(RuntimeError, match=r"only on CPUs with AMX.*precision 3 \(fp32\)"):
            cpu_ops.quant_gemm(torch.empty(2, 8), torch.randn(2, 64), w.data, w.fmt.code, None,
                               None, BEST, int(precision))
        with pytest.raises(RuntimeError, match="AMX"):
            cpu_ops.quant_linear([w.data], [w.fmt.code], [None], None, 64, [1], BEST, int(precision))


def test_int4_is_q4_1_blocks(cpu_ops):
    """int4 quantization at load makes Q4_1 blocks: the same kernel computes both."""
    gen = torch.Generator().manual_seed(3)
    dense = torch.randn(40, 128, generator=gen)
    w = quantize_int4(dense)
    assert w.fmt.name == "q4_1"
    x = torch.randn(5, 128, generator=gen)
    out = torch.empty(5, 40)
    cpu_ops.quant_gemv(out, x, w.data, w.fmt.code, None, None, BEST)
    want = quantized_activations(x, BEST).double() @ dequantize(w).double().T
    assert relative_error(out, want) < 1e-5


def test_kernels_refuse_mismatched_shapes(cpu_ops):
    w = random_weight("q4_0", 8, 64, torch.Generator().manual_seed(4))
    with pytest.raises(RuntimeError, match="quant_gemv"):
        cpu_ops.quant_gemv(torch.empty(1, 8), torch.randn(1, 96), w.data, w.fmt.code, None, None, BEST)
    with pytest.raises(RuntimeError, match="quant_gemm"):
        cpu_ops.quant_gemm(torch.empty(2, 7), torch.randn(2, 64), w.data, w.fmt.code, None, None, BEST,
                           int(GemmPrecision.F32))
    with pytest.raises(RuntimeError, match="unknown format"):
        cpu_ops.quant_gemv(torch.empty(1, 8), torch.randn(1, 64), w.data, 99, None, None, BEST)
    with pytest.raises(RuntimeError, match="scales"):
        cpu_ops.quant_gemv(torch.empty(1, 8), torch.randn(1, 64), w.data.new_zeros(8, 64), 100, None,
                       None, BEST)
    with pytest.raises(RuntimeError, match="is not one this CPU runs"):
        cpu_ops.quant_gemv(torch.empty(1, 8), torch.randn(1, 64), w.data, w.fmt.code, None, None, 7)


@pytest.mark.parametrize("precision", list(GemmPrecision), ids=lambda p: p.name)
def test_linear_segments_pick_gemv_or_gemm_by_rows(cpu_ops, precision):
    """A QuantLinear of three segments in different formats equals each part's own product; rows
    up to a segment's limit take its GEMV, more rows the GEMM in the linear's precision."""
    need_tiles(cpu_ops, precision)
    gen = torch.Generator().manual_seed(6)
    parts = [random_weight(f, n, 64, gen) for f, n in (("q5_0", 16), ("q8_0", 8), ("int8", 8))]
    bias = torch.randn(32, generator=gen)
    limits = [4, 2, 8]
    linear = cpu_ops.quant_linear([p.data for p in parts], [p.fmt.code for p in parts],
                              [p.scales for p in parts], bias, 64, limits, BEST, int(precision))
    assert (linear.in_features, linear.out_features, linear.precision) == (64, 32, precision)
    assert linear.nbytes() == sum(p.nbytes for p in parts)
    dense = torch.cat([dequantize(p) for p in parts]).double()
    for rows in (1, 3, 6):
        x = torch.randn(rows, 64, generator=gen)
        out = linear.forward(x)
        col = 0
        for part, limit in zip(parts, limits, strict=True):
            n = part.shape[0]
            got = out[:, col:col + n].double() - bias[col:col + n].double()
            if rows <= limit:
                want = quantized_activations(x, BEST).double() @ dense[col:col + n].T
            elif precision in (GemmPrecision.BF16X3, GemmPrecision.F32):
                want = x.double() @ dense[col:col + n].T
            elif precision == GemmPrecision.BF16X2:
                want = x.double() @ rounded(dense[col:col + n]).T
            else:
                want = rounded(x) @ rounded(dense[col:col + n]).T
            assert relative_error(got, want) < 2e-5, (rows, part.fmt.name)
            col += n


@needs_vnni
def test_gemm_decoders_without_the_bf16_convert_instruction(cpu_ops):
    """CPUs with AVX512_BF16 round to bf16 in one instruction; the GEMM's decoders written out
    for the others are the same tests run in a process that may not use it."""
    from tests.subprocess_pytest import run_pytest

    if not cpu_ops.bf16_tiles:
        pytest.skip("the bf16 decoders feed bf16 tiles, which torch runs only with AMX")
    run_pytest([__file__, "-k", "gemm and not without_the_bf16 and not fp32"],
               {"PAGEDQ_CPU_BF16_CONVERT": "0"})
