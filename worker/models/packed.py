"""Projections over packed weights, built for the kernels the plan chose.

A projection is one or more column segments (q, k and v fused, gate and up fused): each a
:class:`~pagedq.kernels.block_formats.QuantWeight` or a float tensor a GGUF held in a type no
kernel reads. :func:`build_projection` turns them into an object with ``forward(x)`` (bias
included) and ``nbytes()``:

- ``cpp``: ``torch.classes.pagedq_cpu.QuantLinear``, the C++ GEMV/GEMM pair (the fused layer
  calls it too);
- ``triton``: the weight-only Triton GEMM over each segment's GPU layout;
- ``torch``: each segment dequantized per call for ``F.linear`` (any device, slow: the
  fallback where neither kernel runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedq.kernels.backend import PackedChoice
from pagedq.kernels.block_formats import (
    QuantWeight,
    cpu_kernel_inputs,
    dequantize,
    to_gpu_layout,
    weight_nbytes,
)
from pagedq.kernels.cpu_ops import Isa

Segment = QuantWeight | torch.Tensor


def segment_format(segment: Segment) -> str:
    return segment.fmt.name if isinstance(segment, QuantWeight) else "float32"


segment_bytes = weight_nbytes  # bytes of a segment, packed or float


@dataclass
class TorchProjection:
    """Dequantize every segment per call: correct anywhere, for backends without kernels."""

    segments: list[Segment]
    bias: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dense = [dequantize(s) if isinstance(s, QuantWeight) else s for s in self.segments]
        return F.linear(x, torch.cat(dense).to(x.dtype), self.bias)

    def nbytes(self) -> int:
        return sum(segment_bytes(s) for s in self.segments)


@dataclass
class TritonProjection:
    """The weight-only Triton GEMM per segment (float segments: F.linear), one output."""

    parts: list  # GpuWeight or float tensors on the device
    bias: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pagedq.kernels.triton_quant import triton_quant_linear  # triton: optional, CUDA

        outs = [F.linear(x, p.to(x.dtype)) if isinstance(p, torch.Tensor) else triton_quant_linear(x, p)
                for p in self.parts]
        out = torch.cat(outs, dim=-1)
        return out if self.bias is None else out + self.bias

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() if isinstance(p, torch.Tensor) else p.nbytes
                   for p in self.parts)


def build_projection(segments: list[Segment], bias: torch.Tensor | None,
                     routes: dict[str, PackedChoice], device: torch.device):
    """The runtime object of one projection on the routes chosen for each packed format
    (KernelPlan.packed; see the module docstring)."""
    # what was chosen, read first; then the weights' side, read in one go
    choices = [routes[segment_format(s)] for s in segments]
    first = choices[0]
    if first.kind == "cpp":
        rows = [c.gemv_rows for c in choices]
        grouped = [c.isa == int(Isa.AVX512_VNNI) for c in choices]  # the one-row GEMV's layout
        data, codes, scales = cpu_kernel_inputs(segments, grouped)
        bias = None if bias is None else bias.float().contiguous()
        return first.ops.quant_linear(data, codes, scales, bias, segments[0].shape[1], rows,
                                      first.isa, first.precision_code)
    if first.kind == "triton":
        parts = [to_gpu_layout(s, device) if isinstance(s, QuantWeight) and s.fmt.name != "bf16"
                 else (dequantize(s) if isinstance(s, QuantWeight) else s).to(device)
                 for s in segments]
        return TritonProjection(parts, bias)
    return TorchProjection([s.to(device) for s in segments], bias)
