"""``pagedq bench``: measure the seed's claims for pagedq against its baselines, in one run."""

from __future__ import annotations

import argparse
from typing import Any

from .config import SCENARIOS, BenchConfig, full, quick


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench", help="benchmark pagedq against HF generate and a max-length reservation",
        description="Measure the seed's claims for pagedq against its baselines (HF generate "
                    "with static batches, max-length KV reservation, unchunked prefill, cold "
                    "prefix, in-process engine) in one run. See docs/bench.md.")
    p.add_argument("--quick", action="store_true",
                   help="small traces and short decodes (target: < 3 minutes on 2 CPU cores)")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON here")
    p.add_argument("--plot", metavar="DIR", help="write PNG charts here (needs matplotlib)")
    p.add_argument("--markdown", metavar="PATH",
                   help="write the README's traditional-vs-paged table (Markdown) here")
    p.add_argument("--from-json", metavar="PATH",
                   help="measure nothing: re-print the table (and --markdown) from a saved JSON")
    p.add_argument("--model", default=None,
                   help="model directory, .gguf file or cached org/name (default: SmolLM2-135M)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if present)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="for pagedq and the HF baseline alike (default: float32)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for pagedq and the HF baseline alike (default: torch's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic traces (default: 0)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated subset of: {', '.join(SCENARIOS)} (default: all)")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV block size (default: the engine's, 8 on CPU and 16 on CUDA)")
    p.add_argument("--kv-cache-dtype", default=None,
                   choices=("auto", "float32", "bfloat16", "float16"),
                   help="KV cache dtype of every pagedq engine (default: auto, the model's); "
                   "the decode sweep also runs once with decode_kv_cache_dtype (float16)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="serving engine's sequence cap (default: 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="per-step token budget, the chunk size in the ITL scenario (default: 512)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="serving engine's max_model_len (default: 2048)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests in the throughput trace (default: 16 quick, 64 full)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any BenchConfig field (see worker/bench/config.py), e.g. "
                        "--set decode_new_tokens=32 --set decode_batches=1,8 "
                        "--set prompt_dist=160,0.9,32,512 (median,sigma,low,high)")
    p.add_argument("--llama-cpp", default=None, metavar="DIR",
                   help="directory of llama.cpp's llama-batched-bench, llama-server and "
                        "llama-quantize: measure llama.cpp in the same run (default: "
                        "$PAGEDQ_LLAMA_CPP; scripts/build-llama-cpp.sh builds them)")
    p.add_argument("--redis-url", default=None,
                   help="Redis for the queue scenario (default: a private redis-server)")
    p.set_defaults(func=run_command)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    scenarios = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    overrides: dict[str, Any] = dict(model=args.model, device=args.device, dtype=args.dtype,
                                     threads=args.threads, seed=args.seed, scenarios=scenarios,
                                     redis_url=args.redis_url)
    optional = {"block_size": args.block_size, "kv_cache_dtype": args.kv_cache_dtype,
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "max_model_len": args.max_model_len, "throughput_requests": args.requests,
                "llama_cpp": args.llama_cpp}
    overrides.update({k: v for k, v in optional.items() if v is not None})
    config = quick(**overrides) if args.quick else full(**overrides)
    try:
        return config.with_settings(args.set)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc


def run_bench(config: BenchConfig, json_path: str | None = None,
              plot_dir: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """Run, assemble, write; returns the JSON document and the plot paths (the tests' entry)."""
    from . import report
    from .scenarios import BenchRun

    run = BenchRun(config)
    run.execute()
    doc = report.assemble(run)
    plots: list[str] = []
    if plot_dir:
        plots = [str(p) for p in report.plot(run, doc, plot_dir)]
        doc["plots"] = plots
    if json_path:
        report.write_json(doc, json_path)
    return doc, plots


def run_command(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from . import report

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
