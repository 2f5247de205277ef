"""Packed weight formats: pagedq's PyTorch dequantizers against the gguf package's own NumPy
ones (bit for bit), and the int8 / int4 quantizers of float checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from pagedq.kernels.block_formats import (
    FORMATS,
    GROUP_FIELDS,
    GROUPED,
    QuantWeight,
    dequantize,
    quantize_int4,
    quantize_int8,
)

GGUF_FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")


def random_blocks(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes (any pattern is a valid block) with finite fp16 super-scales."""
    f = FORMATS[fmt]
    raw = rng.integers(0, 256, size=(n, k // f.block * f.nbytes), dtype=np.uint8)
    blocks = raw.reshape(-1, f.nbytes)
    offsets = (208,) if fmt == "q6_k" else (0, 2) if fmt in ("q4_1", "q5_1", "q4_k", "q5_k") else (0,)
    for off in offsets:
        scales = rng.uniform(-0.1, 0.1, size=(blocks.shape[0], 1)).astype(np.float16)
        blocks[:, off:off + 2] = scales.view(np.uint8)
    return raw


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_dequantize_matches_gguf_package(fmt):
    rng = np.random.default_rng(0)
    raw = random_blocks(fmt, 6, 512, rng)
    want = gguf_dequantize(raw, GGMLQuantizationType[fmt.upper()])
    got = dequantize(QuantWeight(FORMATS[fmt], torch.from_numpy(raw), (6, 512)))
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("fmt", ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0"))
def test_dequantize_reads_gguf_quantized_blocks(fmt):
    """Blocks made by gguf's quantizer decode to what gguf decodes them to, near the input."""
    rng = np.random.default_rng(1)
    dense = rng.standard_normal((4, 256)).astype(np.float32)
    raw = gguf_quantize(dense, GGMLQuantizationType[fmt.upper()])
    got = dequantize(QuantWeight(FORMATS[fmt], torch.from_numpy(raw), (4, 256))).numpy()
    np.testing.assert_array_equal(got, gguf_dequantize(raw, GGMLQuantizationType[fmt.upper()]))
    assert np.abs(got - dense).max() < 0.5


def test_int8_is_per_channel_and_close():
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(16, 128, generator=gen) * torch.logspace(-2, 1, 16)[:, None]
    q = quantize_int8(dense)
    assert q.data.shape == (16, 128) and q.scales.shape == (16,)
    assert q.nbytes == 16 * 128 + 16 * 4
    err = (dequantize(q) - dense).abs().amax(dim=1)
    assert torch.all(err <= q.scales * 0.5 + 1e-6)  # half a step of the row's own scale


def test_int4_blocks_are_gguf_q4_1():
    gen = torch.Generator().manual_seed(1)
    dense = torch.randn(8, 96, generator=gen)
    q = quantize_int4(dense)
    assert q.fmt.name == "q4_1" and q.nbytes == 8 * 3 * 20
    ours = dequantize(q)
    theirs = gguf_dequantize(q.data.numpy(), GGMLQuantizationType.Q4_1)
    np.testing.assert_array_equal(ours.numpy(), theirs)
    step = (dense.view(8, 3, 32).amax(-1) - dense.view(8, 3, 32).amin(-1)) / 15
    assert torch.all((ours - dense).abs().view(8, 3, 32).amax(-1) <= step * 0.5 + 2e-3)


def test_rows_selects_packed_rows():
    rng = np.random.default_rng(2)
    w = QuantWeight(FORMATS["q4_k"], torch.from_numpy(random_blocks("q4_k", 5, 256, rng)), (5, 256))
    index = torch.tensor([4, 0, 4])
    torch.testing.assert_close(dequantize(w.rows(index)), dequantize(w)[index], rtol=0, atol=0)
    q = quantize_int8(torch.randn(5, 64))
    torch.testing.assert_close(dequantize(q.rows(index)), dequantize(q)[index], rtol=0, atol=0)


@pytest.mark.parametrize("fmt", tuple(GROUP_FIELDS))
def test_grouped_layout_is_a_permutation_of_the_rows(fmt):
    """Grouping rewrites the bytes in place (16 rows share each block position, field by
    field); dequantizing, picking rows and ungrouping all give the GGUF rows back."""
    rng = np.random.default_rng(3)
    k = 512 if FORMATS[fmt].block == 256 else 96
    raw = torch.from_numpy(random_blocks(fmt, 48, k, rng))
    w = QuantWeight(FORMATS[fmt], raw.clone(), (48, k))
    w.set_grouped(True)
    assert w.grouped and w.kernel_code == FORMATS[fmt].code | GROUPED
    assert not torch.equal(w.data, raw) and w.nbytes == raw.numel()
    assert torch.equal(w.data.flatten().sort().values, raw.flatten().sort().values)
    plain = QuantWeight(FORMATS[fmt], raw, (48, k))
    torch.testing.assert_close(dequantize(w), dequantize(plain), rtol=0, atol=0)
    index = torch.tensor([47, 0, 17, 17, 5])
    assert torch.equal(w.rows(index).data, raw[index])
    assert torch.equal(w.plain().data, raw)
    w.set_grouped(False)
    assert torch.equal(w.data, raw) and not w.grouped


def test_only_whole_groups_of_block_formats_are_grouped():
    rng = np.random.default_rng(4)
    assert not QuantWeight(FORMATS["q8_0"], torch.from_numpy(random_blocks("q8_0", 24, 64, rng)),
                           (24, 64)).groupable
    with pytest.raises(ValueError, match="cannot be grouped"):
        quantize_int8(torch.randn(16, 64)).set_grouped(True)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="K divisible by 256"):
        QuantWeight(FORMATS["q6_k"], torch.zeros(2, 210, dtype=torch.uint8), (2, 96))
    with pytest.raises(ValueError, match="expected"):
        QuantWeight(FORMATS["q8_0"], torch.zeros(2, 30, dtype=torch.uint8), (2, 32))
