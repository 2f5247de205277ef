"""One stream's decode speed: greedy tokens a second after the prefill, best of three runs.

    python scripts/one_stream.py [MODEL] [--cpu-isa LEVEL] [--num-threads 2]

Why: a change to the step's fixed costs (its Python, a one-row kernel) shows at one stream
first, and an A/B of two builds (a worktree of the commit before on PYTHONPATH, alternated with
this one) needs a figure that takes seconds, not the quant bench's minutes. Run a capped level
with its environment too (docs/quantization.md: ``PAGEDQ_CPU_ISA``, ``ONEDNN_MAX_CPU_ISA``, ...).
Name the CPU beside any figure you quote.
"""

from __future__ import annotations

import argparse
import time

from pagedq.params import SamplingParams
from pagedq.worker import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="default: the bundled model")
    parser.add_argument("--cpu-isa", default="auto")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    engine = Engine(args.model, num_kv_blocks=512, num_threads=args.num_threads,
                    kv_cache_dtype="float16", adaptive_threads=False, cpu_isa=args.cpu_isa)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    best = 0.0
    for run in range(4):  # the first warms up
        engine.add_request(f"run-{run}", "Tell me a story about a lighthouse keeper and the sea.",
                           params)
        engine.step()  # the prefill
        start, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        if run:
            best = max(best, steps / (time.perf_counter() - start))
    print(f"{best:.1f} tok/s")


if __name__ == "__main__":
    main()
