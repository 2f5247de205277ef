"""The packed weight formats the kernels read: GGUF block formats and pagedq's own int8 / int4.

A :class:`QuantWeight` is one linear layer's weight ``[N, K]`` kept in its packed form: GGUF
blocks exactly as the file stores them (one row of ``K / block`` blocks per output channel), or a
float checkpoint quantized at load (``int8``: one scale per output channel; ``int4``: groups of
32 with a scale and a minimum, stored in GGUF's Q4_1 block layout so one kernel serves both).
Resident bytes are the file's bytes: nothing is widened.

The dequantizers here are the plain-PyTorch reference every kernel is tested against (and
themselves tested against the ``gguf`` package's NumPy dequantizers). They also serve the rows the
kernels do not compute, such as embedding lookups.

They live beside the kernels that read these bytes (csrc/quant_formats.h mirrors the format codes
and the grouped layout) and import nothing above the kernels: the models layer turns a checkpoint
into these weights (pagedq.worker.models.build), the kernels and their checks take them as they
are.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

QK = 32  # elements per block of the 32-element formats (and per activation block in the kernels)
QK_K = 256  # elements per super-block of the K-quants


@dataclass(frozen=True)
class BlockFormat:
    """One packed layout: ``block`` weights in ``nbytes`` bytes; ``code`` is the id the C++
    kernels take (GGML's type id for GGUF formats)."""

    name: str
    code: int
    block: int
    nbytes: int

    @property
    def bits(self) -> float:
        return 8 * self.nbytes / self.block


# GGML type ids (gguf.GGMLQuantizationType) for the formats the kernels read directly.
FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("q4_0", 2, QK, 18),
        BlockFormat("q4_1", 3, QK, 20),
        BlockFormat("q5_0", 6, QK, 22),
        BlockFormat("q5_1", 7, QK, 24),
        BlockFormat("q8_0", 8, QK, 34),
        BlockFormat("q4_k", 12, QK_K, 144),
        BlockFormat("q5_k", 13, QK_K, 176),
        BlockFormat("q6_k", 14, QK_K, 210),
        # per-channel int8: K int8 values per row, the fp32 scales in QuantWeight.scales
        BlockFormat("int8", 100, 1, 1),
        # plain bf16 rows (GGML's BF16): the same kernels multiply them, unconverted
        BlockFormat("bf16", 30, 1, 2),
    )
}
BY_CODE = {f.code: f for f in FORMATS.values()}

GROUPED = 1 << 10  # kGrouped in kernels/csrc/quant_formats.h: the format code's layout bit
GROUP_ROWS = 16
# The byte fields of each groupable block, in GGUF's order: (size, holds codes). Scales (d, m)
# keep row order in a group; code fields (qh, qs) take the kernel's slot order (group_slots).
GROUP_FIELDS: dict[str, tuple[tuple[int, bool], ...]] = {
    "q4_0": ((2, False), (16, True)),
    "q4_1": ((2, False), (2, False), (16, True)),
    "q5_0": ((2, False), (4, True), (16, True)),
    "q5_1": ((2, False), (2, False), (4, True), (16, True)),
    "q8_0": ((2, False), (32, True)),
    # d, dmin, the 12 bytes of packed 6-bit scales one by one, the four 32-byte runs of nibbles
    "q4_k": ((2, False), (2, False), *((1, False),) * 12, *((32, True),) * 4),
    # the same with the 32 bytes of fifth bits (qh) between the scales and the nibbles
    "q5_k": ((2, False), (2, False), *((1, False),) * 12, (32, True), *((32, True),) * 4),
    # ql and qh in runs of 16 bytes (each 16 codes of one sub-block's row), the 16 int8 scales one
    # by one, d
    "q6_k": (*((16, True),) * 12, *((1, False),) * 16, (2, False)),
}


def group_slots(name: str) -> torch.Tensor:
    """Slot of each of a group's 16 rows in the code fields (group_slot in quant_formats.h)."""
    r = torch.arange(GROUP_ROWS)
    if name in ("q8_0", "q4_k", "q5_k"):  # 2 rows per vector
        return 8 * (r // 8) + 2 * (r % 4) + (r // 4) % 2
    return 4 * (r % 4) + r // 4


@dataclass
class QuantWeight:
    """A linear layer's packed weight: ``data`` uint8 ``[N, row_bytes]`` (``int8``: int8 ``[N, K]``
    plus fp32 ``scales [N]``); computes ``x @ W.T`` through the kernels without unpacking."""

    fmt: BlockFormat
    data: torch.Tensor
    shape: tuple[int, int]  # (N, K): output channels, input features
    scales: torch.Tensor | None = None
    grouped: bool = False  # rows regrouped 16 at a time for the CPU GEMV (see set_grouped)

    def __post_init__(self) -> None:
        n, k = self.shape
        if k % self.fmt.block or k % QK:
            raise ValueError(f"{self.fmt.name} needs K divisible by {max(self.fmt.block, QK)}, got {k}")
        want = (n, k // self.fmt.block * self.fmt.nbytes)
        if tuple(self.data.shape) != want:
            raise ValueError(f"{self.fmt.name} data {tuple(self.data.shape)}, expected {want}")

    @property
    def nbytes(self) -> int:
        extra = self.scales.numel() * self.scales.element_size() if self.scales is not None else 0
        return self.data.numel() * self.data.element_size() + extra

    @property
    def kernel_code(self) -> int:
        """The format code the C++ kernels take (with the layout bit when grouped)."""
        return self.fmt.code | (GROUPED if self.grouped else 0)

    @property
    def groupable(self) -> bool:
        return self.fmt.name in GROUP_FIELDS and self.shape[0] % GROUP_ROWS == 0

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The packed rows ``index`` in GGUF's layout (rows are independent: blocks never
        straddle rows; grouped rows are gathered field by field)."""
        if self.grouped:
            return QuantWeight(self.fmt, _grouped_rows(self.fmt.name, self.data, index),
                               (len(index), self.shape[1]))
        scales = self.scales[index] if self.scales is not None else None
        return QuantWeight(self.fmt, self.data[index].contiguous(), (len(index), self.shape[1]), scales)

    def set_grouped(self, grouped: bool) -> None:
        """Rewrite the rows in place into the grouped layout (or back): the same bytes, permuted.

        Grouped, the 16 rows of a group share each block position, field by field ([d x16]
        [m x16] [qh x16] [qs x16]), which the CPU's one-row GEMV reads 4 rows per vector
        (kernels/csrc/group_gemv.cpp). In place, so a table the embedding and a tied LM head
        share stays one copy, and a few groups at a time, so loading a model never holds a
        second copy of a matrix (a group's bytes stay where its 16 rows were).
        """
        if grouped == self.grouped:
            return
        if grouped and not self.groupable:
            raise ValueError(f"{self.fmt.name} [{self.shape[0]} rows] cannot be grouped")
        _regroup_in_place(self.fmt.name, self.data, _group if grouped else _ungroup)
        self.grouped = grouped

    def plain(self) -> QuantWeight:
        """This weight in GGUF's row layout (itself when not grouped)."""
        if not self.grouped:
            return self
        return QuantWeight(self.fmt, _ungroup(self.fmt.name, self.data), self.shape, self.scales)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self).to(dtype)

    def to(self, device: torch.device | str) -> QuantWeight:
        scales = None if self.scales is None else self.scales.to(device)
        return QuantWeight(self.fmt, self.data.to(device), self.shape, scales, self.grouped)


def weight_nbytes(weight: QuantWeight | torch.Tensor) -> int:
    """Bytes a packed weight or a float tensor takes in memory."""
    if isinstance(weight, QuantWeight):
        return weight.nbytes
    return weight.numel() * weight.element_size()


def cpu_kernel_inputs(segments: list[QuantWeight | torch.Tensor], grouped: list[bool]
                      ) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor | None]]:
    """The C++ QuantLinear's inputs for a projection's segments, read here in one go (data,
    format code and scales of each): a packed segment is first put in the one-row GEMV's
    grouped layout where ``grouped`` asks for it and it can be (in place, see set_grouped); a
    float segment goes as contiguous fp32 with code 0."""
    for segment, group in zip(segments, grouped, strict=True):
        if isinstance(segment, QuantWeight):
            segment.set_grouped(segment.groupable and group)
    data = [s.data if isinstance(s, QuantWeight) else s.float().contiguous() for s in segments]
    codes = [s.kernel_code if isinstance(s, QuantWeight) else 0 for s in segments]
    scales = [s.scales if isinstance(s, QuantWeight) else None for s in segments]
    return data, codes, scales


REGROUP_ROWS = GROUP_ROWS * 16  # rows per step of an in-place regrouping (see _regroup_in_place)


def _regroup_in_place(name: str, data: torch.Tensor, convert) -> None:
    """Rewrite ``data`` with ``convert`` (_group or _ungroup) a few groups at a time: each
    group's bytes stay within its own 16 rows, so the extra memory is one chunk's. Chunks of
    256 rows keep each temporary under glibc's 128 KiB mmap threshold for the bundled model's
    rows, so the allocator reuses one block instead of keeping every freed one (chunks of
    4096 rows left ~40 MB of freed heap resident after loading it)."""
    for start in range(0, data.shape[0], REGROUP_ROWS):
        part = data[start:start + REGROUP_ROWS]
        part.copy_(convert(name, part))


def _group(name: str, data: torch.Tensor) -> torch.Tensor:
    """GGUF rows [N, B * S] -> the grouped layout, same shape (QuantWeight.set_grouped)."""
    fields = GROUP_FIELDS[name]
    size = sum(f for f, _ in fields)
    n = data.shape[0]
    blocks = data.view(n // GROUP_ROWS, GROUP_ROWS, -1, size).transpose(1, 2)  # [G, B, row, S]
    out = torch.empty_like(data)
    dst = out.view(n // GROUP_ROWS, blocks.shape[1], GROUP_ROWS * size)  # [G, B, 16 * S]
    by_slot = torch.argsort(group_slots(name))  # the row each slot holds
    at = 0
    for width, code in fields:
        field = blocks[..., at:at + width]
        target = dst[..., GROUP_ROWS * at:GROUP_ROWS * (at + width)].unflatten(2, (GROUP_ROWS, width))
        target.copy_(field[:, :, by_slot] if code else field)
        at += width
    return out


def _ungroup(name: str, data: torch.Tensor) -> torch.Tensor:
    """The grouped layout -> GGUF rows [N, B * S]."""
    fields = GROUP_FIELDS[name]
    size = sum(f for f, _ in fields)
    n = data.shape[0]
    groups = data.view(n // GROUP_ROWS, -1, GROUP_ROWS * size)  # [G, B, 16 * S]
    slots = group_slots(name)
    parts, at = [], 0
    for width, code in fields:
        field = groups[..., at:at + GROUP_ROWS * width].unflatten(2, (GROUP_ROWS, width))
        parts.append(field[:, :, slots] if code else field)  # [G, B, row, width]
        at += GROUP_ROWS * width
    return torch.cat(parts, dim=3).transpose(1, 2).reshape(n, -1)


@functools.cache
def _row_offsets(name: str) -> torch.Tensor:
    """[16, S]: where each byte of row r's block sits within its group's 16 * S bytes."""
    slots = group_slots(name)
    offsets, at = [], 0
    for width, code in GROUP_FIELDS[name]:
        pos = slots if code else torch.arange(GROUP_ROWS)
        offsets.append(at + pos[:, None] * width + torch.arange(width)[None, :])
        at += GROUP_ROWS * width
    return torch.cat(offsets, dim=1)


def _grouped_rows(name: str, data: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """GGUF rows ``index`` of a grouped weight: one gather (the embedding's lookup per step)."""
    index = index.long().cpu()
    size = sum(f for f, _ in GROUP_FIELDS[name])
    row_bytes = data.shape[1]
    blocks = torch.arange(row_bytes // size) * (GROUP_ROWS * size)
    base = (index // GROUP_ROWS * (GROUP_ROWS * row_bytes))[:, None, None] + blocks[None, :, None]
    return data.view(-1)[base + _row_offsets(name)[index % GROUP_ROWS][:, None, :]].reshape(
        len(index), row_bytes)


# --------------------------------------------------------------------------- dequantization


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from uint8 pairs [nblocks, 2] -> float32 [nblocks, 1]."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] codes: low nibbles are elements 0-15, high nibbles 16-31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1: 4 bytes holding bit j of element j -> [..., 32] of 0/16."""
    bits = qh.long()
    word = bits[..., 0] | bits[..., 1] << 8 | bits[..., 2] << 16 | bits[..., 3] << 24
    return ((word[..., None] >> torch.arange(32)) & 1).to(torch.uint8) << 4


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit (scale, min) pairs -> two [..., 8] int tensors."""
    s = scales.long()
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


@dataclass
class Codes:
    """A weight as integer codes and per-group affine terms: ``w = scale * code + offset``.

    ``codes`` [N, K] (int16), ``scale`` and ``offset`` [N, K / group] (fp32; ``offset`` None when
    zero). Every format decomposes this way exactly: GGML's arithmetic multiplies an fp16 scale by
    a small integer, which fp32 represents without rounding.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group: int

    def dequantize(self) -> torch.Tensor:
        scale = self.scale.repeat_interleave(self.group, dim=1)
        w = scale * self.codes.float()
        return w if self.offset is None else w + self.offset.repeat_interleave(self.group, dim=1)


def _block_codes(name: str, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """b: uint8 [nblocks, nbytes] -> codes [nblocks, block], scale and offset [nblocks, groups]."""
    if name in ("q4_0", "q4_1", "q5_0", "q5_1"):
        five, has_min = name.startswith("q5"), name.endswith("_1")
        qh_at = 4 if has_min else 2  # after d (and m); the nibbles follow qh when there is one
        q = _nibbles(b[:, qh_at + (4 if five else 0):])
        if five:
            q = q | _high_bits(b[:, qh_at:qh_at + 4])
        d = _f16(b[:, 0:2])
        offset = _f16(b[:, 2:4]) if has_min else -(16 if five else 8) * d
        return q.short(), d, offset, QK
    if name == "q8_0":
        return b[:, 2:].contiguous().view(torch.int8).short(), _f16(b[:, 0:2]), None, QK
    if name in ("q4_k", "q5_k"):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _k_scales(b[:, 4:16])
        qs = b[:, -128:].reshape(-1, 4, 1, 32)
        q = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(-1, 8, 32)  # chunk j: subs 2j, 2j+1
        if name == "q5_k":
            qh = b[:, 16:48].reshape(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8)[:, None]
            q = q | ((qh & 1) << 4)
        return q.reshape(-1, QK_K).short(), d * sc, -(dmin * mn), QK
    if name == "q6_k":
        ql, qh = b[:, 0:128].reshape(-1, 2, 1, 64), b[:, 128:192].reshape(-1, 2, 1, 32)
        sc = b[:, 192:208].contiguous().view(torch.int8).float()
        low = torch.cat((ql & 0x0F, ql >> 4), dim=2).reshape(-1, 2, 4, 32)
        high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3
        q = (low | (high << 4)).reshape(-1, QK_K).short() - 32
        return q, _f16(b[:, 208:210]) * sc, None, 16
    raise ValueError(f"no decoder for {name!r}")


def codes(w: QuantWeight) -> Codes:
    """The integer codes and per-group scale/offset of a packed weight (not bf16: no codes)."""
    w = w.plain()
    n, k = w.shape
    if w.fmt.name == "bf16":
        raise ValueError("bf16 weights have no integer codes")
    if w.fmt.name == "int8":
        return Codes(w.data.view(torch.int8).short(), w.scales.float()[:, None], None, k)
    q, scale, offset, group = _block_codes(w.fmt.name, w.data.reshape(-1, w.fmt.nbytes))
    per_row = k // group
    return Codes(q.reshape(n, k), scale.reshape(n, per_row),
                 None if offset is None else offset.reshape(n, per_row), group)


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The float32 ``[N, K]`` matrix a packed weight stands for (GGML's arithmetic, exactly)."""
    if w.fmt.name == "bf16":
        return w.data.view(torch.bfloat16).float()
    return codes(w).dequantize()


# --------------------------------------------------------------------------- quantization


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """Symmetric per-output-channel int8: ``w[n, k] ~ scales[n] * q[n, k]``, q in [-127, 127]."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantWeight(FORMATS["int8"], q.view(torch.uint8), tuple(w.shape), scales.contiguous())


def as_bf16(weight: torch.Tensor) -> QuantWeight:
    """A float weight rounded to bf16 rows, for the kernels' bf16 paths."""
    w = weight.detach().to(torch.bfloat16).contiguous()
    return QuantWeight(FORMATS["bf16"], w.view(torch.uint8), tuple(w.shape))


def quantize_int4(weight: torch.Tensor) -> QuantWeight:
    """Asymmetric 4-bit in groups of 32 (scale and minimum per group, both fp16): GGUF's Q4_1
    block layout, so the Q4_1 kernels compute it."""
    w = weight.detach().float()
    n, k = w.shape
    g = w.reshape(n, k // QK, QK)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(lo))
    q = torch.round((g - m.float()[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)
    blocks = torch.cat((d[..., None].view(torch.uint8), m[..., None].view(torch.uint8), qs), dim=-1)
    return QuantWeight(FORMATS["q4_1"], blocks.reshape(n, -1).contiguous(), (n, k))


# --------------------------------------------------------------------------- GPU layout (Triton)

FOUR_BIT = ("q4_0", "q4_1", "q4_k")  # formats whose codes fit in a nibble


@dataclass
class GpuWeight:
    """A packed weight in the Triton weight-only GEMM's layout: ``w = scale * code + offset`` per
    group of ``group`` inputs. 4-bit codes go two per byte (input 2j in the low nibble), 5-8-bit
    codes one int8 each; scales and offsets are fp32 ``[N, K / group]`` (exact, see Codes)."""

    bits: int
    group: int
    data: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        tensors = [self.data, self.scale] + ([self.offset] if self.offset is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def to_gpu_layout(w: QuantWeight, device: torch.device | str) -> GpuWeight:
    """Re-pack a weight for the Triton kernels (the CPU block layouts interleave scales with
    codes, which GPU loads do not coalesce)."""
    c = codes(w)
    if w.fmt.name in FOUR_BIT:
        q = c.codes.to(torch.uint8)
        data, bits = q[:, 0::2] | (q[:, 1::2] << 4), 4
    else:
        data, bits = c.codes.to(torch.int8), 8
    offset = None if c.offset is None else c.offset.contiguous().to(device)
    return GpuWeight(bits, c.group, data.contiguous().to(device), c.scale.contiguous().to(device),
                     offset, w.shape)
