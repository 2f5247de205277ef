"""Micro-benchmark of every CPU linear path over one model's projections, per row count.

``python -m pagedq.bench.quant_kernels [--rows 1,4,8,16,64,256] [--paths ...] [--threads N]``
times one pass over SmolLM2-135M's 121 weight matrices (30 layers of qkv, o, gate_up and down,
plus the LM head): the passes a decode step makes, with weights too big for the caches the way a
real model's are. Paths: fp32 (the skinny GEMV below 17 rows, oneDNN-prepacked above), bf16
(``F.linear`` and oneDNN-prepacked), torch's weight-only int8/int4 ops (bf16 activations), and
pagedq's packed-weight kernels (``gemv-<format>`` reading the blocks with integer dot products,
grouped 16 rows at a time where the engine groups them, ``rowgemv-<format>`` one row at a time,
``i8gemv-<format>`` / ``i8rowgemv-<format>`` the same on int8 activations (quant_gemv's ``acts``
8: maddubs on AVX2, one vpdpbusd per product grouped on VNNI; Q8_0, Q4_0, Q4_1, Q4_K, and
grouped Q5_0/Q5_1/Q5_K/Q6_K),
``gemm-<format>`` dequantizing bf16 tiles for oneDNN's micro-kernel in precision bf16x3,
``x2gemm-<format>`` in precision bf16x2, ``bf16gemm-<format>`` in precision bf16, all three AMX
only, ``f32gemm-<format>`` dequantizing fp32 tiles for ATen's GEMM, every CPU). The ISA level is
the process's: run it under ``PAGEDQ_CPU_ISA=avx2`` (and oneDNN's cap, cpu_features.
isa_environment) to time an AVX2 machine's paths. K-quants need K % 256 == 0,
so ``--shapes down`` times the 30 down projections (K = 1536) alone. ``--shapes memory`` times
the memory scenario's model instead (SmolLM2-1.7B's shape: 24 layers, hidden 2048, intermediate
8192, 1.7 G weights, far past any cache), for the packed paths only; each row then ends with the
GB/s its packed weights were read at (a pass's bytes over its time), against the streaming
bandwidth printed above the table.

Every matrix call is timed on its own and keeps its fastest time over ``--rounds`` passes (the
paths take turns, pass by pass); a path's figure is the sum of those minima. On a shared machine
other processes only ever add time, and a single call (0.05-5 ms) often runs untouched where a
whole pass would not. Each call still finds its weights where a real pass leaves them: out of
L1/L2, since the other matrices ran in between.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from pagedq.bench.bandwidth import stream_read_gbps
from pagedq.bench.memory_bound import SHAPE as MEMORY_SHAPE
from pagedq.kernels.backend import process_selector
from pagedq.kernels.block_formats import QuantWeight, quantize_int8
from pagedq.kernels.cpu_ops import ActWidth, GemmPrecision, Isa
from pagedq.kernels.crossover import random_blocks

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 576, 1536, 49152, 30
PACKED = ("q4_0", "q4_1", "q5_0", "q8_0", "q4_k", "q6_k", "int8")
PACKED_KINDS = ("gemv", "rowgemv", "i8gemv", "i8rowgemv", "gemm", "x2gemm", "bf16gemm", "f32gemm")
DEFAULT_PATHS = ("fp32", "bf16", "bf16-onednn", "torch-int8", "torch-int4") + tuple(
    f"{kind}-{fmt}" for fmt in ("q4_0", "q4_1", "q8_0", "int8")
    for kind in ("gemv", "gemm", "bf16gemm"))


def model_shapes(which: str) -> list[tuple[int, int]]:
    """(N, K) of every matrix one forward pass multiplies by."""
    if which == "memory":
        h, i = MEMORY_SHAPE["hidden"], MEMORY_SHAPE["intermediate"]
        return [(3 * h, h), (h, h), (2 * i, h), (h, i)] * MEMORY_SHAPE["layers"] + [(VOCAB, h)]
    layer = [(HIDDEN + 2 * 192, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN),
             (HIDDEN, INTERMEDIATE)]
    if which == "down":
        return [(HIDDEN, INTERMEDIATE)] * LAYERS
    return layer * LAYERS + [(VOCAB, HIDDEN)]


def int4_torch(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU int4 layout: packed codes and [K / group, N, 2] bf16 (scale, zero)."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo).clamp(min=1e-8) / 15
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    zeros = lo + 8 * scale
    sz = torch.stack([scale, zeros], -1).transpose(0, 1).contiguous().bfloat16()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2), sz


def build_path(name: str, shapes: list[tuple[int, int]], gen: torch.Generator) -> list[Callable]:
    """One function of {K: x} per matrix of ``shapes`` that multiplies by it the ``name`` way."""
    kind, _, fmt = name.partition("-")
    if kind in PACKED_KINDS:
        return packed_path(kind, fmt, shapes, gen)
    floats = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]
    if name == "fp32":
        choice = process_selector().select("cpu").linear_for("float32")

        def fp32(w: torch.Tensor) -> Callable:
            packed = choice.prepack(w)

            return lambda xs: choice(xs[w.shape[1]], w, None, packed)
        return [fp32(w) for w in floats]
    if name == "bf16":
        return [partial(lambda xs, w: F.linear(xs[w.shape[1]].bfloat16(), w), w=w.bfloat16())
                for w in floats]
    if name == "bf16-onednn":
        return [partial(lambda xs, k, p: torch.ops.mkldnn._linear_pointwise(
                    xs[k].bfloat16(), p, None, "none", [], ""),
                    k=w.shape[1], p=torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64))
                for w in floats]
    if name == "torch-int8":
        return [partial(lambda xs, k, q, s: torch.ops.aten._weight_int8pack_mm(xs[k].bfloat16(), q, s),
                        k=w.shape[1], q=q.data.view(torch.int8), s=q.scales.bfloat16())
                for w in floats for q in [quantize_int8(w)]]
    if name == "torch-int4":
        return [partial(lambda xs, k, p, sz: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    xs[k].bfloat16(), p, 32, sz), k=w.shape[1], p=p, sz=sz)
                for w in floats for p, sz in [int4_torch(w)]]
    raise ValueError(f"unknown path {name!r}")


def packed_path(kind: str, fmt: str, shapes: list[tuple[int, int]],
                gen: torch.Generator) -> list[Callable]:
    """build_path for pagedq's packed kernels; each call's ``nbytes`` is its weight's size."""
    selector = process_selector()
    ops = selector.library()
    isa = selector.packed_isa()
    vnni = isa == int(Isa.AVX512_VNNI)
    int8 = partial(ops.quant_gemv, acts=int(ActWidth.INT8))
    op = {"gemv": ops.quant_gemv, "rowgemv": ops.quant_gemv, "i8gemv": int8, "i8rowgemv": int8,
          "gemm": partial(ops.quant_gemm, precision=int(GemmPrecision.BF16X3)),
          "x2gemm": partial(ops.quant_gemm, precision=int(GemmPrecision.BF16X2)),
          "bf16gemm": partial(ops.quant_gemm, precision=int(GemmPrecision.BF16)),
          "f32gemm": partial(ops.quant_gemm, precision=int(GemmPrecision.F32))}[kind]

    def packed(w: QuantWeight) -> Callable:
        w.set_grouped(vnni and w.groupable and not kind.endswith("rowgemv"))  # the engine's layout

        def call(xs):
            x = xs[w.shape[1]]
            op(x.new_empty(x.shape[0], w.shape[0]), x, w.data, w.kernel_code, w.scales, None, isa)
        call.nbytes = sum(t.numel() * t.element_size() for t in (w.data, w.scales) if t is not None)
        return call
    return [packed(random_blocks(fmt, n, k, gen)) for n, k in shapes]


def time_pass(calls: list[Callable], xs: dict, best: list[float]) -> None:
    """Run every call once, lowering each one's best time in ``best``."""
    for i, call in enumerate(calls):
        start = time.perf_counter()
        call(xs)
        best[i] = min(best[i], time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16,64,256")
    parser.add_argument("--paths", default=",".join(DEFAULT_PATHS))
    parser.add_argument("--shapes", default="model", choices=["model", "down", "memory"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = model_shapes(args.shapes)
    gen = torch.Generator().manual_seed(0)
    names = args.paths.split(",")
    if args.shapes == "memory" and any(n.partition("-")[0] not in PACKED_KINDS for n in names):
        parser.error("--shapes memory times the packed paths only (gemv-q4_k, rowgemv-q8_0, ...)")
    paths = {name: build_path(name, shapes, gen) for name in names}
    print(f"ms per pass over {len(shapes)} matrices (sum of each call's best of {args.rounds}), "
          f"{torch.get_num_threads()} threads")
    if args.shapes == "memory":
        gigabytes = {n: sum(c.nbytes for c in paths[n]) / 1e9 for n in names}
        print("weights read per pass: " + ", ".join(f"{n} {g:.3f} GB" for n, g in gigabytes.items())
              + f"; streaming read {stream_read_gbps(torch.get_num_threads()):.1f} GB/s")
    macs = sum(n * k for n, k in shapes)  # multiply-adds per activation row
    print(f"{'rows':>5}" + "".join(f"{n:>13}" for n in names))
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in shapes}}
        best = {name: [float("inf")] * len(shapes) for name in names}
        for name in names:  # warm-up
            time_pass(paths[name], xs, [float("inf")] * len(shapes))
        for _ in range(args.rounds):
            for name in names:
                time_pass(paths[name], xs, best[name])
        line = f"{rows:>5}" + "".join(f"{sum(best[n]) * 1e3:>13.2f}" for n in names)
        if args.shapes == "memory":  # bandwidth at few rows, products per second at many
            line += "   GB/s " + " ".join(f"{gigabytes[n] / sum(best[n]):.1f}" for n in names)
            line += "   GMAC/s " + " ".join(f"{macs * rows / sum(best[n]) / 1e9:.1f}" for n in names)
        print(line, flush=True)


if __name__ == "__main__":
    main()
