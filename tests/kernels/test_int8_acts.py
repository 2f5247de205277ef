"""The GEMV on int8 activations (quant_gemv's ``acts`` = 8, opt-in) against plain PyTorch.

The oracle applies the kernels' activation rounding in PyTorch (each run of 32 values rounded to
int8 steps of max|x| / 127, nearest even), dequantizes the weights and multiplies in float64: the
kernel must then agree to fp32 accumulation. The AVX2 kernels (byte_gemv.cpp: Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, Q4_K, Q6_K; from 8 rows byte_panel.cpp, all but Q8_0) run at every level; the
grouped VNNI byte mode (group_gemv.cpp) where the process's level has AVX-512 VNNI.
tests/kernels/test_isa_levels.py runs this file again at every lower level.
"""

from __future__ import annotations

import pytest
import torch

from pagedq.kernels.backend import GROUPED_FORMATS, PANEL_ROWS, process_selector
from pagedq.kernels.block_formats import FORMATS, QuantWeight, dequantize
from pagedq.kernels.cpu_ops import INT8_ACTS_BIT, ActWidth, GemmPrecision, Isa
from tests.quant_fixtures import ALL, random_weight

CPU = process_selector().cpu  # this CPU, capped at PAGEDQ_CPU_ISA where that is set
BEST = int(Isa.AVX512_VNNI if CPU.has_avx512_vnni else Isa.AVX2)
BYTE_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q6_k")  # byte_gemv.cpp's
BYTE_PANEL_FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q6_k")  # byte_panel.cpp's (unsigned codes)
GROUPABLE = GROUPED_FORMATS  # grouped by the engine on AVX-512 VNNI
INT8 = int(ActWidth.INT8)
needs_vnni = pytest.mark.skipif(not CPU.has_avx512_vnni,
                                reason=f"grouped rows run on AVX-512 VNNI only (level here: {CPU.level})")


@pytest.fixture(params=[Isa.AVX512_VNNI, Isa.AVX2], ids=lambda i: i.name)
def isa(request) -> int:
    if request.param == Isa.AVX512_VNNI and not CPU.has_avx512_vnni:
        pytest.skip(f"no AVX-512 VNNI at this process's level ({CPU.level})")
    return int(request.param)


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 GEMVs see it: each run of 32 values rounded to steps of max|x| / 127."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # 127 / amax in fp32, as the kernels compute it (an ulp off flips values landing on .5)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127)).view_as(x)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def check(out: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor, what) -> None:
    want = int8_activations(x).double() @ dense.T + bias.double()
    assert relative_error(out, want) < 1e-5, what
    # int8's rounding of the activations, and no more, against the exact product
    assert relative_error(out, x.double() @ dense.T + bias.double()) < 3e-2, what


@pytest.mark.parametrize("fmt", BYTE_FORMATS)
def test_int8_gemv_matches_dequantized_matmul(cpu_ops, isa, fmt):
    """Plain rows on any isa: byte_gemv.cpp's maddubs kernel (AVX2 instructions) below
    PANEL_ROWS rows without VNNI; from there the byte panel (byte_panel.cpp) for the nibble
    formats (groups of 8 rows, a padded last group, 1-3 rows past the groups, two passes of 32
    from 33 rows) and the int16 panel for Q8_0, bit for bit the int16 call."""
    gen = torch.Generator().manual_seed(31)
    for k in (256, 1536) if fmt in ("q4_k", "q6_k") else (32, 96, 576):
        w = random_weight(fmt, 37, k, gen)
        dense = dequantize(w).double()
        bias = torch.randn(37, generator=gen)
        for rows in (1, 3, 7, 8, 11, 17, 36, 67):
            x = torch.randn(rows, k, generator=gen)
            out, plain = torch.empty(rows, 37), torch.empty(rows, 37)
            cpu_ops.quant_gemv(out, x, w.data, w.fmt.code, None, bias, isa, INT8)
            if isa != Isa.AVX512_VNNI and rows >= PANEL_ROWS and fmt not in BYTE_PANEL_FORMATS:
                cpu_ops.quant_gemv(plain, x, w.data, w.fmt.code, None, bias, isa)
                torch.testing.assert_close(out, plain, rtol=0, atol=0)
            else:
                check(out, x, dense, bias, (fmt, k, rows))


def test_int8_gemv_takes_extreme_codes(cpu_ops, isa):
    """Q8_0 codes of -128 and activations at +-max: maddubs' int16 pair sums must not saturate."""
    gen = torch.Generator().manual_seed(32)
    w = random_weight("q8_0", 16, 64, gen)
    blocks = w.data.view(16, 2, 34)
    blocks[:, :, 2:] = torch.tensor([128, 127], dtype=torch.uint8).repeat(16)  # -128, 127, ...
    x = torch.tensor([[1.0, -1.0] * 32, [-3.0, 3.0] * 32])
    out = torch.empty(2, 16)
    cpu_ops.quant_gemv(out, x, w.data, w.fmt.code, None, None, isa, INT8)
    check(out, x, dequantize(w).double(), torch.zeros(16), "extremes")


@pytest.mark.skipif(not CPU.has_wide_panel, reason=f"no AVX-512BW rows at this process's level ({CPU.level})")
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_int8_keeps_the_512_bit_k_quant_rows_at_avx512(cpu_ops, fmt):
    """At the avx512 level the K-quants' 1-7 rows run their 512-bit int16 kernels whatever width
    was asked for (as fast or faster than the 256-bit byte GEMV, and finer): bit for bit the
    int16 call; from 8 rows int8 takes the byte panel."""
    gen = torch.Generator().manual_seed(39)
    w = random_weight(fmt, 24, 512, gen)
    for rows in (1, 3, 7, 9, 16, 40):
        x = torch.randn(rows, 512, generator=gen)
        asked, plain = torch.empty(rows, 24), torch.empty(rows, 24)
        cpu_ops.quant_gemv(asked, x, w.data, w.fmt.code, None, None, int(Isa.AVX512), INT8)
        cpu_ops.quant_gemv(plain, x, w.data, w.fmt.code, None, None, int(Isa.AVX512))
        if rows < PANEL_ROWS:
            torch.testing.assert_close(asked, plain, rtol=0, atol=0)
        else:
            check(asked, x, dequantize(w).double(), torch.zeros(24), (fmt, rows))


@pytest.mark.parametrize("fmt", ["q4_1", "q5_1", "q6_k"])
def test_int8_panel_takes_extreme_codes(cpu_ops, isa, fmt):
    """Every code at its largest (15, 31, 63; Q6_K's scales 127) against activations all at +max
    or -max, 1-19 rows: the byte panel's int16 sums of a block's quads (8 of them for nibbles, 4
    with a fifth bit, 2 for Q6_K) and the row kernels' pairs must not saturate."""
    gen = torch.Generator().manual_seed(38)
    w = random_weight(fmt, 20, 256, gen)
    if fmt == "q6_k":
        blocks = w.data.view(20, 210)
        blocks[:, :192] = 0xFF  # low nibbles and high bits: codes 63
        blocks[:, 192:208] = 127  # every scale
    else:
        five = fmt == "q5_1"
        blocks = w.data.view(20, 8, 24 if five else 20)
        blocks[:, :, -16:] = 0xFF  # both nibbles 15
        if five:
            blocks[:, :, 4:8] = 0xFF  # every fifth bit set: codes 31
    for rows in (1, 5, 8, 19):
        x = torch.where(torch.arange(rows)[:, None] % 2 == 0, 1.0, -1.0).expand(rows, 256).contiguous()
        out = torch.empty(rows, 20)
        cpu_ops.quant_gemv(out, x, w.data, w.fmt.code, None, None, isa, INT8)
        check(out, x, dequantize(w).double(), torch.zeros(20), (fmt, rows, "extremes"))


@needs_vnni
@pytest.mark.parametrize("fmt", GROUPABLE)
def test_grouped_int8_gemv_matches_dequantized_matmul(cpu_ops, fmt):
    """Grouped rows in byte mode: one vpdpbusd per product."""
    gen = torch.Generator().manual_seed(33)
    for k in (256, 1536) if FORMATS[fmt].block == 256 else (32, 96, 576):
        w = random_weight(fmt, 48, k, gen)
        g = QuantWeight(w.fmt, w.data.clone(), w.shape)
        g.set_grouped(True)
        dense = dequantize(w).double()
        bias = torch.randn(48, generator=gen)
        for rows in (1, 3, 8, 9, 20):
            x = torch.randn(rows, k, generator=gen)
            out = torch.empty(rows, 48)
            cpu_ops.quant_gemv(out, x, g.data, g.kernel_code, None, bias, BEST, INT8)
            check(out, x, dense, bias, (fmt, k, rows))


@pytest.mark.parametrize("fmt", [f for f in ALL if f not in BYTE_FORMATS])
def test_formats_without_an_int8_kernel_keep_int16(cpu_ops, isa, fmt):
    """acts = 8 asks for int8 where a kernel exists; plain rows of the other formats run the
    int16 GEMV, bit for bit."""
    gen = torch.Generator().manual_seed(34)
    w = random_weight(fmt, 24, 256, gen)
    x = torch.randn(3, 256, generator=gen)
    asked, plain = torch.empty(3, 24), torch.empty(3, 24)
    cpu_ops.quant_gemv(asked, x, w.data, w.fmt.code, w.scales, None, isa, INT8)
    cpu_ops.quant_gemv(plain, x, w.data, w.fmt.code, w.scales, None, isa)
    torch.testing.assert_close(asked, plain, rtol=0, atol=0)


def test_activation_width_is_checked(cpu_ops):
    w = random_weight("q8_0", 16, 64, torch.Generator().manual_seed(35))
    with pytest.raises(RuntimeError, match="not an activation width"):
        cpu_ops.quant_gemv(torch.empty(1, 16), torch.randn(1, 64), w.data, w.fmt.code, None, None,
                           BEST, 4)


def test_linear_with_the_int8_bit_runs_int8_gemv_and_plain_gemm(cpu_ops):
    """QuantLinear's precision bit: its GEMV rows take int8 activations, its GEMM is untouched."""
    gen = torch.Generator().manual_seed(36)
    parts = [random_weight(f, n, 256, gen) for f, n in (("q4_k", 16), ("q8_0", 8), ("q6_k", 8))]
    bias = torch.randn(32, generator=gen)
    precision = int(GemmPrecision.F32) | INT8_ACTS_BIT
    linear = cpu_ops.quant_linear([p.data for p in parts], [p.fmt.code for p in parts],
                                  [p.scales for p in parts], bias, 256, [4, 4, 4], BEST, precision)
    assert linear.precision == precision
    for rows in (2, 6):
        x = torch.randn(rows, 256, generator=gen)
        out = linear.forward(x)
        col = 0
        for part in parts:
            n = part.shape[0]
            want = torch.empty(rows, n)
            if rows <= 4:
                cpu_ops.quant_gemv(want, x, part.data, part.fmt.code, part.scales, None, BEST, INT8)
            else:
                cpu_ops.quant_gemm(want, x, part.data, part.fmt.code, part.scales, None, BEST,
                                   int(GemmPrecision.F32))
            torch.testing.assert_close(out[:, col:col + n] - bias[col:col + n], want,
                                       rtol=1e-6, atol=1e-5)
            col += n


@pytest.mark.parametrize("isa", [Isa.AVX2, Isa.AVX512], ids=lambda i: i.name)
def test_fused_parts_run_the_byte_panel_when_every_part_has_it(cpu_ops, isa):
    """QuantLinear's fused parts from PANEL_ROWS rows with the int8 bit, below VNNI: Q4_K and
    Q5_0 parts go through the byte panel in one call (each part's columns as its own int8 GEMV);
    a Q6_K or Q8_0 part beside them takes the int16 panel (as without the bit), the others
    still the byte panel, at the AVX-512 level too (whose 512-bit int16 panel was level with it
    on a Zen 5 and slower on an Intel Xeon)."""
    if isa == Isa.AVX512 and not CPU.has_wide_panel:
        pytest.skip(f"no AVX-512BW panel at this process's level ({CPU.level})")
    gen = torch.Generator().manual_seed(37)
    for formats in (("q4_k", "q5_0"), ("q4_k", "q6_k"), ("q5_0", "q8_0", "q5_0")):
        parts = [random_weight(f, n, 512, gen) for f, n in zip(formats, (40, 24, 12), strict=False)]
        precision = int(GemmPrecision.F32) | INT8_ACTS_BIT
        linear = cpu_ops.quant_linear([p.data for p in parts], [p.fmt.code for p in parts],
                                      [p.scales for p in parts], None, 512, [256] * len(parts),
                                      int(isa), precision)
        for rows in (8, 19, 45):
            x = torch.randn(rows, 512, generator=gen)
            out = linear.forward(x)
            col = 0
            for fmt, part in zip(formats, parts, strict=True):
                bytes_ = fmt in BYTE_PANEL_FORMATS
                n = part.shape[0]
                want = torch.empty(rows, n)
                cpu_ops.quant_gemv(want, x, part.data, part.fmt.code, part.scales, None, int(isa),
                                   INT8 if bytes_ else int(ActWidth.INT16))
                torch.testing.assert_close(out[:, col:col + n], want, rtol=1e-6, atol=1e-5)
                if bytes_:
                    check(out[:, col:col + n], x, dequantize(part).double(), torch.zeros(n),
                          (formats, rows))
                col += n
