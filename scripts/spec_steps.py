"""Speculation against off on one bench workload, round after round, and where its steps go.

    python scripts/spec_steps.py --method ngram --workload chat --streams 8 --rounds 12

Why: the spec grid gives each cell 2-4 rounds, and a VM's speed drifts more than that between
rounds (chat at 64 streams, where no step speculates, has read 0.94x off), so a change to the
governor or the drafter is judged here with many rounds of one cell, the two engines' order
alternating each round. Every step of the speculating engine is timed whole (``Engine.step``)
and classed as the governor saw it: drafted (it speculated and verified drafts), draftless (it
was allowed to but no lookup matched) or plain, with its tokens; the governor's own figures for
the bucket print beside them, so a gap between what it believes and what the steps did shows.
Name the CPU and its load beside any figure you quote.

``--uncut`` adds a third engine whose lookup drafts are never cut to the depths that pay
(draft_worth.py), the three rotating their order each round: the A/B of that rule.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from pagedq.bench import spec_scenario
from pagedq.bench.context import BenchContext
from pagedq.bench.options import full


def timed_steps(engine: Any, log: list[dict[str, Any]]) -> None:
    """Wrap ``engine.step``: each step's seconds, tokens and (speculating engines) whether the
    governor let it speculate and whether it verified drafts, appended to ``log``."""
    step, governor = engine.step, engine.drafter.governor if engine.drafter else None
    seen: dict[str, Any] = {}
    if governor is not None:
        record = governor.record

        def recorded(tokens: int, decode_only: bool = True, drafted: bool = True,
                     rows: int | None = None) -> None:
            if governor.pending is not None:
                seen.update(spec=governor.pending[1], drafted=drafted, decode_only=decode_only)
            record(tokens, decode_only, drafted, rows)

        governor.record = recorded

    def timed() -> Any:
        seen.clear()
        start, generated = time.perf_counter(), engine.num_generated_tokens
        out = step()
        log.append({"seconds": time.perf_counter() - start, "running": len(engine.scheduler.running),
                    "tokens": engine.num_generated_tokens - generated, **seen})
        return out

    engine.step = timed


def kind(entry: dict[str, Any]) -> str:
    if not entry.get("spec"):
        return "plain"
    return "drafted" if entry.get("drafted") else "draftless"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="ngram", choices=["ngram", "suffix"])
    parser.add_argument("--workload", default="chat", choices=sorted(spec_scenario.TEXTS))
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--uncut", action="store_true",
                        help="a third engine, its lookup drafts never cut (draft_worth.py)")
    args = parser.parse_args()
    bench = BenchContext(full(num_threads=args.num_threads))
    bench.setup()
    engines = {"off": spec_scenario.spec_engine(bench, None),
               args.method: spec_scenario.spec_engine(bench, args.method, adaptive=True)}
    if args.uncut:
        uncut = engines[f"{args.method}-uncut"] = spec_scenario.spec_engine(
            bench, args.method, adaptive=True)
        uncut.drafter.worth.depth = lambda own, constrained, cost, most: most
    log: list[dict[str, Any]] = []
    timed_steps(engines[args.method], log)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        reqs = spec_scenario.jobs(engines["off"], args.workload, args.streams, 1000 * args.streams + r,
                                  args.max_tokens, f"steps-{r}")
        for batch in spec_scenario.serve_round(engines, reqs, r):  # the order rotated by r
            rates[batch.method].append(spec_scenario.rate([batch]))
        print(f"round {r}: " + ", ".join(f"{n} {v[-1]:.1f} tok/s" for n, v in rates.items()))
    off = statistics.mean(rates["off"])
    for name in list(engines)[1:]:
        spec = statistics.mean(rates[name])
        print(f"{name} / off over {args.rounds} rounds: {spec / off:.3f}x ({spec:.1f} / {off:.1f} tok/s)")
    full_batch = [e for e in log if e["running"] >= args.streams and e.get("decode_only")]
    for name in ("drafted", "draftless", "plain"):
        steps = [e for e in full_batch if kind(e) == name]
        if steps:
            seconds, tokens = sum(e["seconds"] for e in steps), sum(e["tokens"] for e in steps)
            print(f"{name} steps at {args.streams} running: {len(steps)}, {tokens / len(steps):.2f} tokens "
                  f"in {1000 * seconds / len(steps):.2f} ms a step, {tokens / seconds:.1f} tok/s")
    print("governor:", engines[args.method].drafter.governor.snapshot()["buckets"])


if __name__ == "__main__":
    main()
