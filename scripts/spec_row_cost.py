"""What a speculative verify step of r rows costs against a one-row decode step, at one stream.

    python scripts/spec_row_cost.py --cycles 12 --num-threads 1

Why: the speed-up of speculation is about tokens per step over this ratio (each step yields
accepted + 1 tokens and costs the ratio of its rows), and the ratio is a quotient of two times
taken side by side, so a machine's load moves it far less than it moves tok/s. One greedy
sequence decodes on the bundled model (or ``--model``); each step is given a draft of r - 1
tokens (rejected: only the forward pass and one sampling differ from a plain step), r going
1..``--max-rows`` and back, round after round, so a drift of the machine's speed lands on every
r alike. Prints each r's median and fastest step time over the one-row step's. Name the CPU
and its load beside any figure you quote.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedq.params import SamplingParams
from pagedq.worker import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--cycles", type=int, default=12)
    parser.add_argument("--max-rows", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=120)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    rows = list(range(1, args.max_rows + 1))
    engine = Engine(args.model, num_kv_blocks=256, max_num_batched_tokens=512,
                    num_threads=args.num_threads, adaptive_threads=False,
                    speculative_config={"method": "ngram", "adaptive": False,
                                        "num_speculative_tokens": args.max_rows})
    want = [1]
    engine.drafter.propose = lambda seq, budget: [13] * (want[0] - 1)
    prompt = list(range(1000, 1000 + args.prompt_tokens))
    engine.add_request("r", prompt, SamplingParams(
        temperature=0.0, ignore_eos=True, max_tokens=(args.cycles + 2) * len(rows) + 20))
    for _ in range(20):  # the prefill and a few plain steps
        engine.step()
    for r in rows:  # every row count once before timing (first calls pick kernels)
        want[0] = r
        engine.step()
    times: dict[int, list[float]] = {r: [] for r in rows}
    for cycle in range(args.cycles):
        for r in rows if cycle % 2 == 0 else rows[::-1]:
            want[0] = r
            start = time.perf_counter()
            engine.step()
            times[r].append(time.perf_counter() - start)
    median, fastest = statistics.median(times[1]), min(times[1])
    print(f"one-row step: median {median * 1e3:.2f} ms over {args.cycles} rounds")
    print("rows  median/1-row  fastest/1-row")
    for r in rows:
        print(f"{r:4d}  {statistics.median(times[r]) / median:12.3f}  "
              f"{min(times[r]) / fastest:13.3f}")


if __name__ == "__main__":
    main()
