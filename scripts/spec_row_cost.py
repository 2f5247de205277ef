"""What a speculative verify step of r rows a sequence costs against a plain decode step.

    python scripts/spec_row_cost.py --cycles 12 --num-threads 1
    python scripts/spec_row_cost.py --cycles 6 --streams 8 --max-rows 9

Why: the speed-up of speculation is about tokens per step over this ratio (each step yields
accepted + 1 tokens and costs the ratio of its rows), and the ratio is a quotient of two times
taken side by side, so a machine's load moves it far less than it moves tok/s. ``--streams``
greedy sequences decode together on the bundled model (or ``--model``); each step gives each of
them a draft of r - 1 tokens (rejected: only the forward pass and one sampling differ from a
plain step), r going 1..``--max-rows`` and back, round after round, so a drift of the machine's
speed lands on every r alike. Prints each r's median and fastest step time over the plain
step's (one row a sequence), which is the tokens a step must yield per sequence to break even.
At several streams the rows are what drafts cost: 8 sequences x r rows against 8 plain rows.
Name the CPU and its load beside any figure you quote.
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
    parser.add_argument("--streams", type=int, default=1)
    args = parser.parse_args()
    rows = list(range(1, args.max_rows + 1))
    streams = args.streams
    engine = Engine(args.model, num_kv_blocks=256 * streams, max_num_seqs=streams,
                    max_num_batched_tokens=max(512, streams * (args.max_rows + 1)),
                    num_threads=args.num_threads, adaptive_threads=False,
                    speculative_config={"method": "ngram", "adaptive": False,
                                        "num_speculative_tokens": args.max_rows})
    want = [1]
    engine.drafter.propose = lambda seq, budget: [13] * (want[0] - 1)
    prompt = list(range(1000, 1000 + args.prompt_tokens))
    for i in range(streams):
        engine.add_request(f"r{i}", [1000 + i] + prompt, SamplingParams(
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
    print(f"plain step ({streams} sequences x 1 row): median {median * 1e3:.2f} ms over "
          f"{args.cycles} rounds")
    print("rows/seq  median/plain  fastest/plain")
    for r in rows:
        print(f"{r:8d}  {statistics.median(times[r]) / median:12.3f}  "
              f"{min(times[r]) / fastest:13.3f}")


if __name__ == "__main__":
    main()
