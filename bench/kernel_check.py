"""GPU check of the kernels: correctness against the reference, then decode bandwidth.

``python -m pagedq.bench.kernel_check`` (CUDA only; elsewhere it says so and exits with status 2):

1. Triton and SDPA paged attention vs ``reference_paged_attention`` in bf16 and fp16 on
   realistic shapes (32 query / 8 KV heads, head_dim 128, block 16; contexts 1k-32k; decode
   batches 1-256; mixed prefill-chunk + decode steps; split-KV), and the Triton cache write.
2. Decode attention bandwidth: bytes of K/V read / kernel time, as a fraction of the device's
   peak (from a table by device name, else a measured device-to-device copy).
3. The weight-only Triton GEMM (w8a16, w4a16; bench/quant_kernel_check.py): correctness against
   dequantize-then-matmul, then decode bandwidth (packed bytes read / time) next to ``F.linear``
   on the widened weights.
4. With ``--engine-model PATH``: decode steps/s of the whole engine (``pagedq.worker.Engine``).

``--compile-only 90`` needs no GPU: it compiles the Triton kernels to a CUDA binary for that
compute capability (Triton ships ptxas), which catches GPU lowering errors on a CPU machine.

Exit status: 0 all checks passed, 1 a check failed, 2 no CUDA device (and no --compile-only).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from pagedq.bench.quant_kernel_check import check_quant
from pagedq.kernels.attention import paged_attention, write_kv
from pagedq.kernels.cases import PagedCase, empty_cache, make_case
from pagedq.kernels.plan import plan_attention
from pagedq.kernels.reference import reference_paged_attention, reference_write_kv
from pagedq.params import SamplingParams
from pagedq.worker import Engine

NO_CUDA_EXIT = 2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
PEAK_TBPS = {  # HBM bandwidth by device-name substring, first match wins
    "H200": 4.8,
    "H100 SXM": 3.35,
    "H100 NVL": 3.9,
    "H100 PCIe": 2.0,
    "H100": 3.35,
    "GH200": 4.0,
    "B200": 8.0,
    "A100-SXM4-80GB": 2.04,
    "A100 80GB PCIe": 1.94,
    "A100": 1.56,
    "L40S": 0.864,
    "L40": 0.864,
    "A10G": 0.6,
    "A10": 0.6,
    "L4": 0.3,
    "RTX 4090": 1.01,
    "RTX 3090": 0.936,
    "T4": 0.32,
}


@dataclass
class Shape:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pagedq.bench.kernel_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--dtypes", default="bf16,fp16", help="comma list of bf16, fp16")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller cases")
    parser.add_argument("--skip-bandwidth", action="store_true")
    parser.add_argument("--engine-model", default=None, help="model path: measure engine steps/s")
    parser.add_argument("--engine-batch", type=int, default=64)
    parser.add_argument("--engine-tokens", type=int, default=128)
    parser.add_argument("--compile-only", type=int, default=None, metavar="CC",
                        help="compile the kernels for compute capability CC (e.g. 90), no GPU")  # fmt: skip
    args = parser.parse_args(argv)
    for name in args.dtypes.split(","):
        if name not in DTYPES:
            parser.error(f"unknown dtype {name!r}; use a comma list of {', '.join(DTYPES)}")
    return args


def correctness_cases(quick: bool) -> list[tuple[str, list[int], list[int], int | None]]:
    """(name, q_lens, context_lens, forced num_splits) covering decode, prefill, mixed, split."""
    gen = torch.Generator().manual_seed(0)
    rand = lambda n, lo, hi: torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    cases = [
        ("decode b=1 ctx=1k", [1], [1024], None),
        ("decode b=8 ctx=4k-8k", [1] * 8, rand(8, 4096, 8192), None),
        ("decode b=256 ctx=1k-2k", [1] * 256, rand(256, 1000, 2048), None),
        ("decode b=1 ctx=32k split=8", [1], [32767], 8),
        ("prefill 2048 at ctx=0", [2048], [0], None),
        ("chunk 1000 at ctx=7000 + 32 decodes", [1000] + [1] * 32, [7000] + rand(32, 1, 4096), None),
    ]
    if not quick:
        cases += [
            ("decode b=64 ctx=4k", [1] * 64, [4096] * 64, None),
            ("decode b=4 ctx=32k", [1] * 4, [32768 - 1] * 4, None),
            ("mixed chunks + decodes split=4", [37, 300, 1, 1, 5], [0, 9000, 20000, 13, 7], 4),
        ]
    return cases


def _max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("nan")
    return (out.float() - ref.float()).abs().max().item()


def check_attention(
    dtype: torch.dtype,
    cases: list[tuple[str, list[int], list[int], int | None]],
    shape: Shape,
    device: str = "cuda",
) -> bool:
    """Both CUDA backends (triton, sdpa) vs the reference on each case; one line per case."""
    # triton: optional (CUDA builds of torch bring it; this check runs on a GPU)
    from pagedq.kernels.triton_attention import triton_paged_attention

    ok = True
    for name, q_lens, ctx, splits in cases:
        case = make_case(q_lens, ctx, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                         shape.block_size, dtype, device)  # fmt: skip
        ref = reference_paged_attention(*case.attention_args())
        plan = plan_attention(case.block_table, case.seq_lens, case.cu_seqlens_q, shape.block_size)
        scale = shape.head_dim**-0.5
        tri = triton_paged_attention(case.query, case.k_cache, case.v_cache, plan, scale, splits)
        tor = paged_attention(*case.attention_args(), backend="sdpa", plan=plan)
        errors = {"triton": _max_error(tri, ref), "sdpa": _max_error(tor, ref)}
        passed = all(e <= TOLERANCE[dtype] for e in errors.values())  # NaN fails
        ok &= passed
        detail = "  ".join(f"{k} {v:.2e}" for k, v in errors.items())
        print(f"  {'ok  ' if passed else 'FAIL'} {name:<38} max|err| {detail}")
        del case, ref, tri, tor
    return ok


def check_write(
    dtype: torch.dtype,
    shape: Shape,
    device: str = "cuda",
    num_blocks: int = 4096,
    num_tokens: int = 5000,
) -> bool:
    """The Triton cache write vs plain indexing (a joint-KV view, 1 in 7 tokens padding)."""
    cache_args = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim, dtype, device)
    k_cache, v_cache = empty_cache(*cache_args, layout="joint")
    ref_k, ref_v = empty_cache(*cache_args)
    slots = torch.randperm(num_blocks * shape.block_size, device=device)[:num_tokens]
    slots[::7] = -1
    key = torch.randn(num_tokens, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype)
    value = torch.randn_like(key)
    write_kv(key, value, k_cache, v_cache, slots, backend="triton")
    keep = slots >= 0
    ref_k.view(-1, *ref_k.shape[2:])[slots[keep]] = key[keep]
    ref_v.view(-1, *ref_v.shape[2:])[slots[keep]] = value[keep]
    passed = torch.equal(k_cache.nan_to_num(0), ref_k.nan_to_num(0)) and torch.equal(
        v_cache.nan_to_num(0), ref_v.nan_to_num(0)
    )
    small = make_case([3, 1], [5, 9], block_size=8, dtype=dtype, device=device, write_new=False)
    mapping = small.slot_mapping.clone()
    mapping[1] = -1
    k_ref, v_ref = small.k_cache.clone(), small.v_cache.clone()
    reference_write_kv(small.new_keys, small.new_values, k_ref, v_ref, mapping)
    write_kv(small.new_keys, small.new_values, small.k_cache, small.v_cache, mapping, "triton")
    passed &= torch.equal(small.k_cache.nan_to_num(0), k_ref.nan_to_num(0))
    print(f"  {'ok  ' if passed else 'FAIL'} triton write_kv ({num_tokens} tokens, 1/7 padding)")
    return passed


def time_cuda(fn: Callable[[], object], repeats: int = 20) -> float:
    """Median seconds per call, timed with CUDA events after a warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def peak_bandwidth() -> tuple[float, str]:
    """Peak HBM bandwidth in bytes/s: from the table, else 1 GiB device-to-device copy."""
    name = torch.cuda.get_device_name()
    for key, tbps in PEAK_TBPS.items():
        if key in name:
            return tbps * 1e12, f"{name}: table peak {tbps} TB/s"
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src))
    measured = 2 * src.numel() / seconds
    return measured, f"{name}: not in table, measured copy {measured / 1e12:.2f} TB/s"


def kv_bytes(case: PagedCase) -> int:
    """Bytes of K and V a decode step must read: every context token, every KV head."""
    _, _, heads, dim = case.k_cache.shape
    return int(case.seq_lens.sum()) * heads * dim * case.k_cache.element_size() * 2


def check_bandwidth(dtype: torch.dtype, quick: bool, shape: Shape) -> None:
    peak, source = peak_bandwidth()
    print(f"  peak: {source}")
    grid = [(1, 32768), (8, 8192), (64, 4096), (256, 2048)]
    if not quick:
        grid += [(1, 4096), (16, 32768), (128, 8192), (256, 8192)]
    print(f"  {'batch':>5} {'context':>7} {'backend':>7} {'us/call':>9} {'TB/s':>6} {'of peak':>8}")
    for batch, ctx in grid:
        elem = torch.tensor([], dtype=dtype).element_size()
        needed = 4 * batch * ctx * shape.num_kv_heads * shape.head_dim * elem * 2  # cache + init
        if needed > torch.cuda.mem_get_info()[0]:
            print(f"  {batch:>5} {ctx:>7} skipped: needs ~{needed / 2**30:.0f} GiB free")
            continue
        case = make_case([1] * batch, [ctx - 1] * batch, shape.num_heads, shape.num_kv_heads,
                         shape.head_dim, shape.block_size, dtype, "cuda")  # fmt: skip
        plan = plan_attention(case.block_table, case.seq_lens, case.cu_seqlens_q, shape.block_size)
        for backend in ("triton", "sdpa"):
            if backend == "sdpa" and batch * ctx > 64 * 4096:
                continue  # the sdpa path gathers K/V into a copy; skip the huge ones
            seconds = time_cuda(partial(paged_attention, *case.attention_args(), backend=backend,
                                        plan=plan))  # fmt: skip
            rate = kv_bytes(case) / seconds
            print(f"  {batch:>5} {ctx:>7} {backend:>7} {seconds * 1e6:>9.1f} "
                  f"{rate / 1e12:>6.2f} {rate / peak:>7.0%}")  # fmt: skip
        del case, plan
        torch.cuda.empty_cache()


def check_engine(args: argparse.Namespace, dtype_name: str) -> None:
    """Decode steps/s of the engine on ``--engine-batch`` prompts."""
    dtype = {"bf16": "bfloat16", "fp16": "float16"}[dtype_name]
    engine = Engine(model=args.engine_model, dtype=dtype, device="cuda",
                    max_num_seqs=args.engine_batch)  # fmt: skip
    prompts = [[1 + (i * 7 + j) % 1000 for j in range(32)] for i in range(args.engine_batch)]
    params = SamplingParams(max_tokens=args.engine_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    steps = max(len(o.outputs[0].token_ids) for o in outputs)
    print(f"  engine {dtype}: batch {args.engine_batch}, {tokens} tokens in {seconds:.2f} s: "
          f"{steps / seconds:.1f} decode steps/s, {tokens / seconds:.0f} tokens/s "
          "(prefill included)")  # fmt: skip


def _signature(kernel, pointer_type: Callable[[str], str], constexprs: dict) -> dict[str, str]:
    """Triton signature: pointers by name, ``scale`` fp32, other runtime arguments i32."""
    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointer_type(name)
        else:
            sig[name] = "fp32" if name == "scale" else "i32"
    return sig


def compile_kernels(capability: int, dtypes: list[str]) -> list[str]:
    """Compile every kernel variant the engine launches for ``sm_<capability>``; no GPU needed.

    Returns one line per variant. Raises Triton's compilation error on the first failure.
    """
    # triton: optional (CUDA builds of torch bring it; this check runs on a GPU)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedq.kernels import triton_attention as ta
    from pagedq.kernels import triton_cache as tc

    target = GPUTarget("cuda", capability, 32)
    shape = Shape()
    group = shape.num_heads // shape.num_kv_heads
    lines = []
    for name in dtypes:
        ty = {"bf16": "bf16", "fp16": "fp16"}[name]
        for splits, max_q_len in ((1, 1), (4, 1), (1, 512)):
            block_q, block_m = ta._tile_rows(group, max_q_len)
            consts = dict(GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=ta.BLOCK_N,
                          BLOCK_D=shape.head_dim, NUM_SPLITS=splits, IEEE_FP32=False,
                          DOT_IN_FP32=False)  # fmt: skip
            out_ty = "*fp32" if splits > 1 else f"*{ty}"
            pointer = lambda n, out_ty=out_ty, ty=ty: {
                "out_ptr": out_ty, "lse_ptr": "*fp32", "q_ptr": f"*{ty}",
                "k_cache_ptr": f"*{ty}", "v_cache_ptr": f"*{ty}",
            }.get(n, "*i32")  # fmt: skip
            sig = _signature(ta._paged_attention_kernel, pointer, consts)
            triton.compile(ASTSource(ta._paged_attention_kernel, sig, consts), target=target)
            lines.append(f"sm_{capability} {name} attention BLOCK_M={block_m} splits={splits}")
        consts = dict(NUM_SPLITS=4, BLOCK_D=shape.head_dim)
        pointer = lambda n, ty=ty: f"*{ty}" if n == "out_ptr" else "*fp32"
        sig = _signature(ta._merge_splits_kernel, pointer, consts)
        triton.compile(ASTSource(ta._merge_splits_kernel, sig, consts), target=target)
        consts = dict(BLOCK_H=shape.num_kv_heads, BLOCK_D=shape.head_dim)
        pointer = lambda n, ty=ty: "*i64" if n == "slot_ptr" else f"*{ty}"
        sig = _signature(tc._write_kv_kernel, pointer, consts)
        triton.compile(ASTSource(tc._write_kv_kernel, sig, consts), target=target)
        lines.append(f"sm_{capability} {name} merge_splits, write_kv")
        lines += _compile_weight_only(target, ty)
    return lines


def _compile_weight_only(target, ty: str) -> list[str]:
    """The weight-only GEMM (kernels/triton_quant.py) for 4- and 8-bit codes, with offsets
    (int4, Q4_1-like) and without (int8), at the decode and prefill tile heights."""
    # triton: optional (CUDA builds of torch bring it; this check runs on a GPU)
    import triton
    from triton.compiler import ASTSource

    from pagedq.kernels import triton_quant as tq

    lines = []
    for bits, group, offset in ((4, 32, True), (8, 4096, False)):
        for block_m in (16, 64):
            consts = dict(BITS=bits, GROUP=group, HAS_OFFSET=offset, HAS_BIAS=False,
                          BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=tq.BLOCK_K, DOT_IN_FP32=False,
                          IEEE_FP32=False)  # fmt: skip
            pointer = lambda n, bits=bits: {
                "x_ptr": f"*{ty}", "out_ptr": f"*{ty}", "w_ptr": "*u8" if bits == 4 else "*i8",
            }.get(n, "*fp32")  # fmt: skip
            sig = _signature(tq._wq_linear_kernel, pointer, consts)
            triton.compile(ASTSource(tq._wq_linear_kernel, sig, consts), target=target)
            lines.append(f"sm_{target.arch} {ty} weight-only GEMM w{bits} BLOCK_M={block_m}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compile_only is not None:
        for line in compile_kernels(args.compile_only, args.dtypes.split(",")):
            print(f"  ok   compiled {line}")
        return 0
    if not torch.cuda.is_available():
        print(
            "No CUDA device: this check runs the Triton kernels on a GPU and measures bandwidth, "
            "so there is nothing to check here. On CPU the kernels are validated in Triton's "
            "interpreter by `pytest tests/kernels/test_triton_interpreter.py`, and `--compile-only 90` "
            "compiles them for a GPU without one.",
            file=sys.stderr,
        )
        return NO_CUDA_EXIT
    shape = Shape()
    ok = True
    print(f"device: {torch.cuda.get_device_name()}")
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        print(f"[{name}] correctness vs reference (tolerance {TOLERANCE[dtype]:g})")
        ok &= check_attention(dtype, correctness_cases(args.quick), shape)
        ok &= check_write(dtype, shape)
        if not args.skip_bandwidth:
            print(f"[{name}] decode attention bandwidth (K/V bytes read / time)")
            check_bandwidth(dtype, args.quick, shape)
        print(f"[{name}] weight-only GEMM (w8a16 / w4a16) vs dequantize-then-matmul"
              + ("" if args.skip_bandwidth else ", then decode bandwidth"))
        peak = None if args.skip_bandwidth else peak_bandwidth()[0]
        ok &= check_quant(dtype, args.quick, not args.skip_bandwidth, time_cuda, peak)
        if args.engine_model:
            check_engine(args, name)
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
