"""Micro-benchmark of paged attention per call (one layer) on SmolLM2-like shapes.

``python -m pagedq.kernels.bench [--backend torch] [--device cpu] [--dtype float32]``
prints the median time of one ``paged_attention`` call with a prebuilt plan (as the engine does
for every layer after the first) and the one-off plan-building time per step.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedq.kernels.attention import paged_attention
from pagedq.kernels.cases import make_case
from pagedq.kernels.plan import plan_attention

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


def bench_case(q_lens, ctx, args, repeats: int) -> tuple[float, float]:
    """(seconds per attention call with a plan, seconds to build the plan)."""
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
    plan = build()
    call = lambda: paged_attention(*case.attention_args(), backend=args.backend, plan=plan)
    plan_time = time_call(lambda: build().derived("torch", _torch_plan), device, repeats)
    return time_call(call, device, repeats), plan_time


def _torch_plan(plan):
    from pagedq.kernels.torch_attention import build_torch_plan

    return build_torch_plan(plan)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, choices=["torch", "triton"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--batches", default="1,8,32,64,128")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"{'case':<34}{'ms/call':>10}{'ms/plan':>10}")
    for batch in [int(b) for b in args.batches.split(",")]:
        ctx = torch.randint(128, 513, (batch,), generator=gen).tolist()
        per_call, per_plan = bench_case([1] * batch, ctx, args, args.repeats)
        name = f"decode b={batch} ctx 128-512"
        print(f"{name:<34}{per_call * 1e3:>10.3f}{per_plan * 1e3:>10.3f}")
    for q_len, ctx in ((512, 0), (256, 256)):
        per_call, per_plan = bench_case([q_len], [ctx], args, max(3, args.repeats // 4))
        name = f"prefill q={q_len} ctx={ctx}"
        print(f"{name:<34}{per_call * 1e3:>10.3f}{per_plan * 1e3:>10.3f}")
    mixed_q = [256] + [1] * 32
    mixed_ctx = [0] + torch.randint(128, 513, (32,), generator=gen).tolist()
    per_call, per_plan = bench_case(mixed_q, mixed_ctx, args, args.repeats)
    print(f"{'mixed 256-chunk + 32 decodes':<34}{per_call * 1e3:>10.3f}{per_plan * 1e3:>10.3f}")


if __name__ == "__main__":
    main()
