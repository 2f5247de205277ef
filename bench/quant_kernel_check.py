"""GPU check of the weight-only Triton GEMM (w8a16, w4a16), part of ``python -m pagedq.bench.kernel_check``.

1. Correctness: per-channel int8, grouped int4 (GGUF Q4_1 blocks), and GGUF Q8_0 and Q4_0
   blocks of Llama-3-8B-sized projections, against dequantize-then-matmul in fp64, at decode and
   prefill row counts.
2. Bandwidth: a decode step streams every weight once, so bytes read (packed codes, scales,
   activations) / kernel time, against the device's peak, next to ``F.linear`` on the same
   weights widened to the activations' dtype (the 16-bit model the packed one replaces).

:func:`check_case` is device-agnostic so the tests run it in Triton's interpreter on tiny shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from pagedq.kernels.block_formats import (
    FORMATS,
    QuantWeight,
    dequantize,
    quantize_int4,
    quantize_int8,
    to_gpu_layout,
)

# (N, K) of Llama-3-8B's projections: q/o, the fused gate+up's half, down
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))
ROWS = (1, 8, 64)  # decode batches; the correctness pass adds a prefill chunk
PREFILL_ROWS = 512
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}


def make_weight(mode: str, n: int, k: int, gen: torch.Generator):
    """A packed weight of ``mode`` (int8, int4 or a GGUF block format) from N(0, 0.02) values."""
    dense = torch.randn(n, k, generator=gen) * 0.02
    if mode == "int8":
        return quantize_int8(dense)
    if mode == "int4":
        return quantize_int4(dense)
    blocks = quantize(dense.numpy(), GGMLQuantizationType[mode.upper()])
    return QuantWeight(FORMATS[mode], torch.from_numpy(blocks).reshape(n, -1), (n, k))


def check_case(w, rows: int, dtype: torch.dtype, device: str, gen: torch.Generator) -> float:
    """Relative max error of the Triton GEMM against dequantize-then-matmul in fp64."""
    from pagedq.kernels.triton_quant import triton_quant_linear  # triton: optional (GPU)

    k = w.shape[1]
    x = torch.randn(rows, k, generator=gen).to(dtype)
    out = triton_quant_linear(x.to(device), to_gpu_layout(w, device))
    want = x.double() @ dequantize(w).double().T
    return ((out.double().cpu() - want).abs().max() / want.abs().max()).item()


def check_quant(dtype: torch.dtype, quick: bool, bandwidth: bool,
                time_fn: Callable[[Callable[[], object]], float], peak: float | None) -> bool:
    """Correctness of every mode on every shape, then (``bandwidth``) decode GB/s per shape."""
    gen = torch.Generator().manual_seed(0)
    modes = ("int8", "int4") if quick else ("int8", "int4", "q8_0", "q4_0")
    ok = True
    for mode in modes:
        for n, k in SHAPES[:1] if quick else SHAPES:
            w = make_weight(mode, n, k, gen)
            for rows in (*ROWS, PREFILL_ROWS):
                err = check_case(w, rows, dtype, "cuda", gen)
                passed = err < TOLERANCE[dtype]
                ok &= passed
                print(f"  {'ok  ' if passed else 'FAIL'} {mode} {n}x{k} rows={rows}: "
                      f"rel err {err:.1e}")
            if bandwidth:
                print_bandwidth(mode, w, dtype, time_fn, peak)
                torch.cuda.empty_cache()
    return ok


def print_bandwidth(mode: str, w, dtype: torch.dtype,
                    time_fn: Callable[[Callable[[], object]], float], peak: float | None) -> None:
    """One line per decode batch: the Triton GEMM's time and GB/s, and dense F.linear's time."""
    from pagedq.kernels.triton_quant import triton_quant_linear  # triton: optional (GPU)

    n, k = w.shape
    gpu = to_gpu_layout(w, "cuda")
    dense = dequantize(w).to("cuda", dtype)
    packed_bytes = sum(t.numel() * t.element_size()
                       for t in (gpu.data, gpu.scale, gpu.offset) if t is not None)
    for rows in ROWS:
        x = torch.randn(rows, k, device="cuda", dtype=dtype)
        ours = time_fn(lambda x=x: triton_quant_linear(x, gpu))
        theirs = time_fn(lambda x=x: F.linear(x, dense))
        rate = (packed_bytes + x.numel() * x.element_size()) / ours
        share = f" ({rate / peak:.0%} of peak)" if peak else ""
        print(f"  {mode} {n}x{k} rows={rows}: {ours * 1e6:.1f} us, {rate / 1e9:.0f} GB/s{share}; "
              f"dense {str(dtype).removeprefix('torch.')} F.linear {theirs * 1e6:.1f} us "
              f"({theirs / ours:.2f}x)")
