"""Where a decode step's time goes: the fused layer's parts (qkv, attention, o, MLP) against
the rest of the step (embedding, head, sampling, the scheduler's Python), from torch.profiler.

    python scripts/profile_step.py --streams 64 --num-threads 2 [--packed-activations int8]

It decodes ``--new-tokens`` tokens for ``--streams`` prompts of ``--prompt-tokens`` tokens on the
bundled model (or ``--model``), profiles the decode steps only (after the prefill), and prints
each named scope's share of the wall time. Name the CPU beside any figure you quote.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pagedq.params import SamplingParams
from pagedq.worker import Engine

SCOPES = ("pagedq::qkv_proj", "pagedq::rope_attention", "pagedq::o_proj", "pagedq::mlp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--packed-activations", default="int16")
    parser.add_argument("--cpu-isa", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", help="float16: the quant bench's cache")
    args = parser.parse_args()
    engine = Engine(args.model, num_kv_blocks=2048, num_threads=args.num_threads,
                    packed_activations=args.packed_activations, cpu_isa=args.cpu_isa,
                    kv_cache_dtype=args.kv_cache_dtype,
                    enable_prefix_caching=False, adaptive_threads=False)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    wall, steps = decode(engine, args, params, profiler=None)  # timed without the profiler
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode(engine, args, params, profiler=prof)
    totals = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages()}
    print(f"{steps} decode steps, {args.streams} streams: {wall / steps * 1e3:.2f} ms a step, "
          f"{args.streams * steps / wall:.0f} tok/s (timed without the profiler)")
    fused = 0.0
    for name in SCOPES:
        ms = totals.get(name, 0.0) / steps
        fused += ms
        print(f"  {name:<24} {ms:7.2f} ms a step  {ms / (wall / steps * 1e3):6.1%}")
    rest = wall / steps * 1e3 - fused
    print(f"  {'rest of the step':<24} {rest:7.2f} ms a step  {rest / (wall / steps * 1e3):6.1%}"
          "  (norms, LM head, sampling, Python)")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20))


def decode(engine: Engine, args: argparse.Namespace, params: SamplingParams,
           profiler: profile | None) -> tuple[float, int]:
    """Prefill ``args.streams`` prompts, then time their decode steps: (seconds, steps)."""
    prompts = [[10 + (i * 7 + j * 13) % 9000 for j in range(args.prompt_tokens)]
               for i in range(args.streams)]
    tag = "p" if profiler else "t"
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}{i}", ids, params)
    started: set[str] = set()
    while len(started) < args.streams:  # the prefill: until every stream has its first token
        started.update(out.request_id for out in engine.step())
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return time.perf_counter() - start, steps


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
