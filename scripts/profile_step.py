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
    args = parser.parse_args()
    engine = Engine(args.model, num_kv_blocks=2048, num_threads=args.num_threads,
                    packed_activations=args.packed_activations, cpu_isa=args.cpu_isa,
                    enable_prefix_caching=False, adaptive_threads=False)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    prompts = [[10 + (i * 7 + j * 13) % 9000 for j in range(args.prompt_tokens)]
               for i in range(args.streams)]
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    started: set[str] = set()
    while len(started) < args.streams:  # the prefill: until every stream has its first token
        started.update(out.request_id for out in engine.step())
    start = time.perf_counter()
    steps = 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    wall = time.perf_counter() - start
    totals = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages()}
    print(f"{steps} decode steps, {args.streams} streams: {wall / steps * 1e3:.1f} ms a step "
          f"(profiled), {args.streams * steps / wall:.0f} tok/s")
    fused = 0.0
    for name in SCOPES:
        ms = totals.get(name, 0.0)
        fused += ms
        print(f"  {name:<24} {ms / steps:7.2f} ms a step  {ms / (wall * 1e3):6.1%}")
    print(f"  {'rest of the step':<24} {(wall * 1e3 - fused) / steps:7.2f} ms a step  "
          f"{1 - fused / (wall * 1e3):6.1%}")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
