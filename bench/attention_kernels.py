"""Micro-benchmark of paged attention per call (one layer) on SmolLM2-like shapes.

``python -m pagedq.bench.attention_kernels [--paths cpp,sdpa] [--device cpu] [--dtype float32] [--threads 1]``
prints the best time of one ``paged_attention`` call with a prebuilt plan (as the engine does
for every layer after the first) and the one-off plan-building time per step, for each attention
backend side by side. By default those are what the backend selector picks for the device (on an
AVX2 CPU the C++ kernel reading the paged cache in place, ``cpp``; Triton on CUDA) and the portable
gather + SDPA (``sdpa``, what ``PAGEDQ_CPU_KERNEL=0`` leaves).
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from pagedq.kernels.attention import paged_attention
from pagedq.kernels.backend import ATTENTION, select_backend
from pagedq.kernels.cases import make_case
from pagedq.kernels.plan import plan_attention
from pagedq.kernels.torch_attention import derive_torch_plan

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, device: torch.device, repeats: int) -> float:
    """Fastest wall time of ``fn()`` in seconds over ``repeats`` calls, after one warm-up call.

    The minimum, not the median: on a shared machine other processes only ever add time.
    """
    fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return min(samples)


def bench_case(q_lens, ctx, args, repeats: int, paths: list[str]) -> tuple[list[float], float]:
    """([seconds per attention call with a plan, per path], seconds to build the first path's plan)."""
    device = torch.device(args.device)
    case = make_case(
        q_lens,
        ctx,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        dtype=DTYPES[args.dtype],
        device=device,
    )
    build = lambda: plan_attention(case.block_table, case.seq_lens, case.cu_seqlens_q, args.block_size)
    per_call = []
    for path in paths:
        plan = build()
        call = partial(paged_attention, *case.attention_args(), backend=path, plan=plan)
        per_call.append(time_call(call, device, repeats))
    kv_heads = args.kv_heads if paths[0] == "cpp" else 0
    plan_time = time_call(lambda: derive_torch_plan(build(), kv_heads), device, repeats)
    return per_call, plan_time


def _paths(args) -> list[str]:
    """The attention backends to time: ``--paths``, or the selector's pick and SDPA."""
    if args.paths != "auto":
        paths = args.paths.split(",")
        unknown = sorted(set(paths) - set(ATTENTION))
        if unknown:
            raise SystemExit(f"--paths: unknown attention {unknown}; choose from {ATTENTION}")
        return paths
    chosen = select_backend(args.device, DTYPES[args.dtype], head_dim=args.head_dim).attention
    return [chosen, "sdpa"] if chosen != "sdpa" else ["sdpa"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--batches", default="1,8,32,64,128")
    parser.add_argument("--paths", default="auto",
                        help=f"attention backends to time, comma-separated from {','.join(ATTENTION)} "
                        "(default: the selector's choice for the device, then sdpa)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = _paths(args)
    gen = torch.Generator().manual_seed(0)
    print(f"{'case':<34}" + "".join(f"{'ms ' + p:>12}" for p in paths) + f"{'ms/plan':>10}")

    def report(name: str, q_lens: list[int], ctx: list[int], repeats: int) -> None:
        per_call, per_plan = bench_case(q_lens, ctx, args, repeats, paths)
        print(f"{name:<34}" + "".join(f"{t * 1e3:>12.3f}" for t in per_call) + f"{per_plan * 1e3:>10.3f}")

    for batch in [int(b) for b in args.batches.split(",")]:
        ctx = torch.randint(128, 513, (batch,), generator=gen).tolist()
        report(f"decode b={batch} ctx 128-512", [1] * batch, ctx, args.repeats)
    for q_len, ctx in ((512, 0), (256, 256), (16, 300)):
        report(f"prefill q={q_len} ctx={ctx}", [q_len], [ctx], max(3, args.repeats // 4))
    mixed_ctx = [0] + torch.randint(128, 513, (32,), generator=gen).tolist()
    report("mixed 256-chunk + 32 decodes", [256] + [1] * 32, mixed_ctx, args.repeats)


if __name__ == "__main__":
    main()
