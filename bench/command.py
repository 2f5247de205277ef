"""``pagedq bench``: measure pagedq against its baselines in one run, print the report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pagedq.bench.options import ALL_SCENARIOS, SCENARIOS, BenchConfig, full, quick
from pagedq.worker.config import EngineConfig
from pagedq.worker.config_flags import add_engine_flags, given

SEED_HELP = "Seed of the synthetic traces and of the engines' random draws (default: 0)"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench", help="benchmark pagedq against HF generate and a max-length reservation",
        description="Measure pagedq against its baselines (HF generate with static batches, "
                    "max-length KV reservation, unchunked prefill, cold prefix, the in-process "
                    "engine, llama.cpp) in one run, and print how each figure compares with "
                    "its target.")
    p.add_argument("--quick", action="store_true",
                   help="small traces and short decodes (target: < 3 minutes on 2 CPU cores)")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON here")
    p.add_argument("--plot", metavar="DIR", help="write PNG charts here (needs matplotlib)")
    p.add_argument("--markdown", metavar="PATH",
                   help="write the README's traditional-vs-paged table (Markdown) here")
    p.add_argument("--from-json", metavar="PATH",
                   help="measure nothing: re-print the table (and --markdown) from a saved JSON")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated subset of: {', '.join(ALL_SCENARIOS)} (default: all "
                        "but shared and memory, which run when named)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests in the throughput trace (default: 16 quick, 64 full)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any BenchConfig field (see bench/options.py), e.g. "
                        "--set decode_new_tokens=32 --set decode_batches=1,8 "
                        "--set prompt_dist=160,0.9,32,512 (median,sigma,low,high)")
    p.add_argument("--llama-cpp", default=None, metavar="DIR",
                   help="directory of llama.cpp's llama-batched-bench, llama-server and "
                        "llama-quantize: measure llama.cpp in the same run (default: "
                        "$PAGEDQ_LLAMA_CPP; scripts/build-llama-cpp.sh builds them)")
    p.add_argument("--redis-url", default=None,
                   help="Redis for the queue scenario (default: a private redis-server)")
    add_engine_flags(p, defaults=BenchConfig(), helps={"seed": SEED_HELP})
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    scenarios = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    unknown = sorted(set(scenarios) - set(ALL_SCENARIOS))
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; choose from {', '.join(ALL_SCENARIOS)}")
    overrides: dict[str, Any] = {**given(args, EngineConfig), "scenarios": scenarios,
                                 "redis_url": args.redis_url}
    optional = {"throughput_requests": args.requests, "llama_cpp": args.llama_cpp}
    overrides.update({k: v for k, v in optional.items() if v is not None})
    config = quick(**overrides) if args.quick else full(**overrides)
    try:
        return config.with_settings(args.set)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc


def run(args: argparse.Namespace) -> int:
    # imported when the command runs: the bench's modules load torch, transformers and the
    # engine, which `pagedq --help` and every other command's start-up need not pay for
    from pagedq.bench import report
    from pagedq.bench.run import run_bench

    if args.from_json:
        doc, plots = json.loads(Path(args.from_json).read_text()), []
    else:
        doc, plots = run_bench(config_from_args(args), args.json, args.plot)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(report.markdown(doc))
    print(report.table(doc))
    machine = doc["machine"]
    print(f"\n{machine['device']}, {machine['cpu_affinity_cores']} cores, "
          f"{machine['torch_threads']} torch threads; peak RSS "
          f"{report._fmt(doc['peak_rss_mb']['pagedq'])} MB (pagedq), "
          f"{report._fmt(doc['peak_rss_mb']['with_hf_baseline'])} MB (with HF); "
          f"total {doc['elapsed_s'].get('total', 0):.0f} s")
    if args.json and not args.from_json:
        print(f"JSON: {args.json}")
    if args.markdown:
        print(f"Markdown: {args.markdown}")
    for path in plots:
        print(f"plot: {path}")
    return 1 if doc["errors"] else 0
