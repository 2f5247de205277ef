"""Weight-only quantized GEMM in Triton (w8a16, w4a16): ``out = x @ W.T`` with W packed.

W arrives in :class:`~pagedq.kernels.block_formats.GpuWeight`'s layout: integer codes (4-bit, two
per byte, or 8-bit) and an fp32 scale (and optional offset) per group of inputs, so one kernel
serves per-channel int8, grouped int4 and every GGUF block format. Each program owns a
``BLOCK_M x BLOCK_N`` output tile; per ``BLOCK_K`` step it loads the codes, expands them with
their group's scale and offset in registers and feeds ``tl.dot`` in the activations' dtype, with
an fp32 accumulator. The weights cross memory packed: that is the whole gain for decode, which
streams every weight once per step.

Triton 3.9's CPU interpreter computes ``tl.dot`` on bf16 operands wrongly (numpy has no bf16),
so off CUDA the tiles go to ``tl.dot`` in fp32 (``DOT_IN_FP32``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 32  # inputs per step: one group of the 32-wide formats


@triton.jit
def _wq_linear_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    offset_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    s_rows = rn.to(tl.int64)[None, :] * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & n_ok[None, :]
        if BITS == 4:
            byte = tl.load(w_rows + (kk // 2)[:, None], mask=w_ok, other=0)
            q = ((byte >> ((kk % 2) * 4)[:, None]) & 0xF).to(tl.float32)
        else:
            q = tl.load(w_rows + kk[:, None], mask=w_ok, other=0).to(tl.float32)
        group = (kk // GROUP)[:, None]
        w = q * tl.load(scale_ptr + s_rows + group, mask=w_ok, other=0.0)  # [BLOCK_K, BLOCK_N]
        if HAS_OFFSET:
            w += tl.load(offset_ptr + s_rows + group, mask=w_ok, other=0.0)
        if DOT_IN_FP32:
            acc += tl.dot(x.to(tl.float32), w)
        elif IEEE_FP32:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def triton_quant_linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for x ``[M, K]`` (fp32, fp16 or bf16) and a GpuWeight ``w``."""
    m, k = x.shape
    n = w.shape[0]
    if k != w.shape[1]:
        raise ValueError(f"x has {k} inputs, the weight {w.shape[1]}")
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _wq_linear_kernel[grid](
        x, w.data, w.scale, w.offset if w.offset is not None else w.scale,
        bias if bias is not None else w.scale, out,
        m, n, k, x.stride(0), w.data.stride(0), w.scale.stride(0), out.stride(0),
        BITS=w.bits, GROUP=w.group, HAS_OFFSET=w.offset is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        DOT_IN_FP32=x.dtype != torch.float32 and not x.is_cuda,
        IEEE_FP32=x.dtype == torch.float32,
    )  # fmt: skip
    return out
