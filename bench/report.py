"""Turn a BenchContext's raw measurements into the report's figures: JSON, a terminal table, PNGs.

Every figure key is always present in the JSON. A figure that could not be
measured is ``null`` and ``unavailable[key]`` says why (a missing dependency, a failed
scenario, or a scenario that was not selected), so a reader never mistakes a gap for a number.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

from pagedq.bench import memory_bound, quant_scenario, shared_cpu, spec_scenario
from pagedq.bench.bandwidth import stream_read_gbps
from pagedq.bench.context import BenchContext
from pagedq.bench.contiguous import same_running_set_utilization
from pagedq.bench.options import BenchConfig
from pagedq.bench.structured_scenario import figures as _structured
from pagedq.bench.timeline import p99_over_p50, summarize
from pagedq.redact import redact_url

FIGURE_KEYS = (
    "kv_utilization",
    "kv_utilization_contiguous",
    "concurrency_vs_contiguous",
    "throughput_vs_hf_static",
    "itl_p99_over_p50_chunked",
    "itl_p99_over_p50_unchunked",
    "prefix_ttft_ratio",
    "queue_throughput_vs_inprocess",
    "gateway_throughput_vs_sdk",
    "gateway_added_ttft_p50_ms",
    "decode_tok_s_by_batch",
    "kv_blocks_n4_vs_unshared",
    "kv_blocks_beam4_vs_unshared",
    "structured_throughput_ratio",
)

# Which scenarios each figure needs (their failure or absence explains a missing figure).
NEEDS: dict[str, tuple[str, ...]] = {
    "kv_utilization": ("capacity",),
    "kv_utilization_contiguous": ("capacity",),
    "concurrency_vs_contiguous": ("capacity",),
    "throughput_vs_hf_static": ("serving", "throughput_pagedq", "throughput_hf"),
    "itl_p99_over_p50_chunked": ("itl",),
    "itl_p99_over_p50_unchunked": ("itl",),
    "prefix_ttft_ratio": ("serving", "prefix"),
    "queue_throughput_vs_inprocess": ("serving", "throughput_pagedq", "queue"),
    "gateway_throughput_vs_sdk": ("gateway",), "gateway_added_ttft_p50_ms": ("gateway",),
    "decode_tok_s_by_batch": ("serving", "decode_pagedq", "decode_hf"),
    "kv_blocks_n4_vs_unshared": ("serving", "sharing"),
    "kv_blocks_beam4_vs_unshared": ("serving", "sharing"),
    "structured_throughput_ratio": ("structured",),
}
SCENARIO_OF = {
    "kv_utilization": "capacity", "kv_utilization_contiguous": "capacity",
    "concurrency_vs_contiguous": "capacity", "throughput_vs_hf_static": "throughput",
    "itl_p99_over_p50_chunked": "itl", "itl_p99_over_p50_unchunked": "itl",
    "prefix_ttft_ratio": "prefix", "queue_throughput_vs_inprocess": "queue",
    "gateway_throughput_vs_sdk": "gateway", "gateway_added_ttft_p50_ms": "gateway",
    "decode_tok_s_by_batch": "decode",
    "kv_blocks_n4_vs_unshared": "sharing", "kv_blocks_beam4_vs_unshared": "sharing",
    "structured_throughput_ratio": "structured",
}

# Reference numbers the targets were set against: SmolLM2-135M-Instruct, f32, on a 2-core CPU.
# They are comparable only for that model on that machine; the report carries them as context.
LLAMA_CPP_BATCHED_TG = {"1": 40.0, "8": 147.0, "32": 193.0, "64": 204.0}
HF_BATCHED_TG_REFERENCE = {"1": 16.0, "8": 62.0, "32": 130.0, "64": 161.0}
LLAMA_CPP_SERVER_MIXED_TOK_S = 78.0
HF_STATIC_MIXED_TOK_S_REFERENCE = 26.0


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def machine_info(run: BenchContext) -> dict[str, Any]:
    device = run.config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    info: dict[str, Any] = {
        "cpu_logical_cores": os.cpu_count(),
        "cpu_physical_cores": psutil.cpu_count(logical=False),
        "cpu_affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else None,
        "cpu_model": _cpu_model(),
        **_cpu_level(run),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": metadata.version("transformers"),  # its version, not its 3 s import
        "platform": platform.platform(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_peak_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return info


def _cpu_level(run: BenchContext) -> dict[str, Any]:
    """The CPU's vector extensions, the ISA level the engines ran at (``--cpu-isa``), the
    streaming read bandwidth measured now and the GEMV/GEMM crossovers measured on this CPU
    (kernels/crossover.py): a figure without its CPU is not a figure."""
    # measured: pagedq.kernels takes ~0.7 s to import after torch; `pagedq bench --from-json`
    # renders a report without selecting kernels
    from pagedq.kernels.backend import process_selector
    from pagedq.kernels.cpu_features import detect_cpu_features
    from pagedq.kernels.crossover import kept_for_this_cpu

    machine = detect_cpu_features()
    return {"cpu_flags": machine.summary(), "cpu_isa_levels": list(machine.levels),
            "cpu_isa_used": process_selector(run.config.cpu_isa).cpu.level,
            "stream_read_gbps": round(stream_read_gbps(run.config.num_threads), 1),
            "kernel_crossovers": kept_for_this_cpu()}


def _cpu_model() -> str | None:
    from pagedq.kernels.cpu_features import cpuinfo_fields  # lazy, as _cpu_level's imports

    return cpuinfo_fields().get("model name") or platform.processor() or None


def _agreement(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict[str, float] | None:
    """How often two systems' greedy outputs match (a sanity check, not a figure)."""
    common = [k for k in a if k in b]
    if not common:
        return None
    exact = sum(a[k] == b[k] for k in common) / len(common)
    prefix = []
    for k in common:
        same = next((i for i, (x, y) in enumerate(zip(a[k], b[k], strict=False)) if x != y),
                    min(len(a[k]), len(b[k])))
        prefix.append(same / max(len(a[k]), 1))
    return {"requests_identical": exact, "mean_matching_prefix": float(np.mean(prefix))}


def _capacity(res: dict[str, Any], out: dict[str, Any]) -> None:
    run, sim = res["capacity"]["run"], res["capacity"]["sim"]
    cap = res["capacity"]
    mean_seq = cap["trace"]["sequence_tokens_mean"]
    max_len = sim.max_model_len
    out["kv_utilization"] = run.kv_utilization()
    out["kv_utilization_contiguous"] = sim.kv_utilization()
    out["concurrency_vs_contiguous"] = _ratio(run.peak_running(), sim.peak_running())
    busy = run.busy()
    out["details"]["capacity"] = {
        "kv_budget_tokens": cap["budget_tokens"],
        "max_model_len": max_len,
        "trace": cap["trace"],
        "paged_peak_running": run.peak_running(),
        "reserved_peak_running": sim.peak_running(),
        "reserved_capacity": sim.capacity,
        "paged_kv_utilization_per_step": run.kv_utilization_per_step(),
        "contiguous_same_running_set": same_running_set_utilization(
            [s.tokens_live for s in busy], [s.running for s in busy], max_len),
        "paged_steps": run.steps,
        "reserved_steps": len(sim.steps),
        "preemptions": run.stats_after.get("preemptions"),
        "concurrency_target": 0.9 * max_len / mean_seq,
        "method": "paged: engine.stats() after every step, time-weighted; reserved: simulated "
                  "max_model_len reservation per request at the same KV budget, per step",
    }


def _throughput(res: dict[str, Any], out: dict[str, Any]) -> None:
    paged = res.get("throughput_pagedq")
    hf = res.get("throughput_hf")
    tps, ttft, itl = out["tokens_per_s"], out["ttft_s"], out["itl_s"]
    detail: dict[str, Any] = {"trace": res.get("throughput_trace")}
    if paged is not None:
        tps["pagedq"] = paged.timeline.tokens_per_s
        ttft["pagedq"] = summarize(paged.timeline.ttfts())
        itl["pagedq"] = summarize(paged.timeline.itls())
        detail.update(pagedq_elapsed_s=paged.timeline.elapsed,
                      pagedq_output_tokens=paged.timeline.output_tokens,
                      pagedq_preemptions=paged.stats_after.get("preemptions"),
                      pagedq_kv_utilization=paged.kv_utilization())
    if hf is not None:
        tps["hf_static"] = hf["timeline"].tokens_per_s
        ttft["hf_static"] = summarize(hf["timeline"].ttfts())
        itl["hf_static"] = summarize(hf["timeline"].itls())
        detail.update(hf_elapsed_s=hf["timeline"].elapsed,
                      hf_output_tokens=hf["timeline"].output_tokens)
    if paged is not None and hf is not None:
        out["throughput_vs_hf_static"] = _ratio(tps["pagedq"], tps["hf_static"])
        detail["greedy_agreement_pagedq_vs_hf"] = _agreement(paged.outputs, hf["outputs"])
    server = (res.get("llama_cpp") or {}).get("throughput")
    if server is not None:
        tps["llama_cpp_server"] = server["tokens_per_s"]
        detail["llama_cpp_server"] = {k: v for k, v in server.items() if k != "outputs"}
        if paged is not None:
            detail["throughput_vs_llama_cpp_server"] = _ratio(tps["pagedq"], tps["llama_cpp_server"])
            detail["greedy_agreement_pagedq_vs_llama_cpp"] = _agreement(paged.outputs,
                                                                        server["outputs"])
    out["details"]["throughput"] = detail


def _itl(res: dict[str, Any], out: dict[str, Any]) -> None:
    detail = {}
    for mode in ("chunked", "unchunked"):
        r = res["itl"][mode]
        out[f"itl_p99_over_p50_{mode}"] = p99_over_p50(r["itls"])
        stall_share = len(res["itl"][mode]["streams"]) / max(r["itls"].size, 1)
        detail[mode] = {"itl_s": summarize(r["itls"]),
                        "one_stall_per_stream_share": stall_share,
                        "max_itl_s": float(r["itls"].max()) if r["itls"].size else None,
                        "long_prompt_ttft_s": r["long_ttft_s"],
                        "max_num_batched_tokens": r["max_num_batched_tokens"]}
    out["details"]["itl"] = detail


def _prefix(res: dict[str, Any], out: dict[str, Any]) -> None:
    p = res["prefix"]
    cold, warm = float(np.median(p["ttft_cold_s"])), float(np.median(p["ttft_cached_s"]))
    out["prefix_ttft_ratio"] = _ratio(warm, cold)
    out["details"]["prefix"] = {**p, "ttft_cold_median_s": cold, "ttft_cached_median_s": warm}


def _sharing(res: dict[str, Any], out: dict[str, Any]) -> None:
    sh = res["sharing"]
    out["kv_blocks_n4_vs_unshared"] = _ratio(sh["n4_peak_blocks"], sh["unshared_blocks"])
    out["kv_blocks_beam4_vs_unshared"] = _ratio(sh["beam4_peak_blocks"], sh["unshared_blocks"])
    out["details"]["sharing"] = sh


def _queue(res: dict[str, Any], out: dict[str, Any]) -> None:
    q, paged = res["queue"], res["throughput_pagedq"]
    out["tokens_per_s"]["pagedq_via_redis"] = q["tokens_per_s"]
    before, after = paged.timeline.tokens_per_s, res.get("queue_inprocess_after_tok_s")
    baseline = before if after is None else (before + after) / 2
    out["queue_throughput_vs_inprocess"] = _ratio(q["tokens_per_s"], baseline)
    out["details"]["queue"] = {
        "inprocess_tok_s_before": before, "inprocess_tok_s_after": after,
        "inprocess_tok_s_baseline": baseline,
        "elapsed_s": q["elapsed_s"], "output_tokens": q["output_tokens"],
        "worker_ready_s": q["worker_ready_s"], "worker_command": q["worker_command"],
        "outputs_equal_inprocess": _agreement(q["outputs"], paged.outputs),
    }


def _gateway(res: dict[str, Any], out: dict[str, Any]) -> None:
    g = res["gateway"]
    out["tokens_per_s"]["pagedq_via_gateway"] = g["http"]["tokens_per_s"]
    out["gateway_throughput_vs_sdk"] = g["throughput_vs_sdk"]
    out["gateway_added_ttft_p50_ms"] = g["added_ttft_p50_ms"]
    out["details"]["gateway"] = g


def _queue_baseline(doc: dict[str, Any]) -> float | None:
    """The in-process tok/s the Redis figure is divided by (mean of the runs around it)."""
    q = (doc.get("details") or {}).get("queue") or {}
    return q.get("inprocess_tok_s_baseline", (doc.get("tokens_per_s") or {}).get("pagedq"))


def _pagedq_series(dec: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, label) of each measured pagedq decode sweep: "" for the main one, else its cache."""
    return [(k, k.removeprefix("pagedq_")) if k != "pagedq" else (k, "") for k in dec
            if k.startswith("pagedq") and dec[k]]


def _decode(res: dict[str, Any], out: dict[str, Any]) -> None:
    paged, hf = res.get("decode_pagedq"), res.get("decode_hf")
    kv = res.get("decode_pagedq_kv") or {}

    def by_batch(rows: list[dict[str, float]] | None) -> dict[str, float] | None:
        return {str(r["b"]): r["s_tg"] for r in rows} if rows else None

    out["decode_tok_s_by_batch"] = {
        "pagedq": by_batch(paged),
        "hf_static": by_batch(hf),
        "llama_cpp_reference": LLAMA_CPP_BATCHED_TG,
        "rows": {"pagedq": paged, "hf_static": hf},
        "columns": "llama-batched-bench: PP TG B N_KV T_PP S_PP T_TG S_TG T S (seconds, tok/s)",
    }
    cpp_rows = (res.get("llama_cpp") or {}).get("decode_rows")
    if cpp_rows:  # llama-batched-bench in this run (see llama_cpp.py)
        out["decode_tok_s_by_batch"]["llama_cpp"] = by_batch(cpp_rows)
        out["decode_tok_s_by_batch"]["rows"]["llama_cpp"] = cpp_rows
    if kv.get("rows"):  # the same sweep with e.g. an fp16 KV cache (llama.cpp's default)
        name = f"pagedq_kv_{kv['kv_cache_dtype']}"
        out["decode_tok_s_by_batch"][name] = by_batch(kv["rows"])
        out["decode_tok_s_by_batch"]["rows"][name] = kv["rows"]


def _targets(out: dict[str, Any]) -> dict[str, Any]:
    """The targets next to the measured value (None when it cannot be judged)."""

    def check(value: float | None, ok: Any, text: str) -> dict[str, Any]:
        return {"target": text, "value": value, "met": None if value is None else bool(ok(value))}

    cap = out["details"].get("capacity", {})
    conc_target = cap.get("concurrency_target")
    dec_all = out.get("decode_tok_s_by_batch") or {}
    like = judged_series(dec_all)
    dec = dec_all.get(like) or {}
    kv_note = ", f16 KV cache like llama.cpp" if like != "pagedq" else ""
    cpp = llama_cpp_figures(out)
    return {
        "kv_utilization": check(out["kv_utilization"], lambda v: v >= 0.97, ">= 0.97"),
        "concurrency_vs_contiguous": check(
            out["concurrency_vs_contiguous"],
            lambda v: conc_target is not None and v >= conc_target,
            f">= 0.9 x max_model_len / mean sequence length = {_fmt(conc_target)}"),
        "throughput_vs_hf_static": check(out["throughput_vs_hf_static"], lambda v: v >= 4, ">= 4"),
        "decode_64_streams_tok_s": _vs_llama_cpp(
            dec.get("64"), LLAMA_CPP_FACTORS["decode_64_streams_tok_s"], cpp["64"],
            f"(default model, CPU{kv_note})"),
        "decode_1_stream_tok_s": _vs_llama_cpp(
            dec.get("1"), LLAMA_CPP_FACTORS["decode_1_stream_tok_s"], cpp["1"],
            f"(default model, CPU{kv_note})"),
        "mixed_trace_tok_s": _vs_llama_cpp(
            out["tokens_per_s"].get("pagedq"), LLAMA_CPP_FACTORS["mixed_trace_tok_s"],
            cpp["server"], "(full profile)"),
        "itl_p99_over_p50_chunked": check(out["itl_p99_over_p50_chunked"], lambda v: v <= 2,
                                          "<= 2 (unchunked far above)"),
        "prefix_ttft_ratio": check(out["prefix_ttft_ratio"], lambda v: v <= 0.2, "<= 0.2"),
        "queue_throughput_vs_inprocess": check(out["queue_throughput_vs_inprocess"],
                                               lambda v: v >= 0.95, ">= 0.95"),
        "gateway_throughput_vs_sdk": check(out["gateway_throughput_vs_sdk"],
                                           lambda v: v >= 0.95, ">= 0.95"),
        "gateway_added_ttft_p50_ms": check(out["gateway_added_ttft_p50_ms"],
                                           lambda v: v <= 10, "<= 10 ms"),
        "structured_throughput_ratio": check(out["structured_throughput_ratio"],
                                             lambda v: v >= 0.9, ">= 0.9"),
    }


# The targets against llama.cpp: pagedq's figure >= factor x llama.cpp's.
LLAMA_CPP_FACTORS = {"decode_1_stream_tok_s": 0.9, "decode_64_streams_tok_s": 1.2,
                     "mixed_trace_tok_s": 1.3}


def judged_series(dec: dict[str, Any]) -> str:
    """The pagedq decode sweep the llama.cpp targets are judged on: llama.cpp keeps its default
    f16 KV cache, so pagedq's f16-cache sweep when the run has one."""
    return "pagedq_kv_float16" if dec.get("pagedq_kv_float16") else "pagedq"


def llama_cpp_figures(out: dict[str, Any]) -> dict[str, tuple[float | None, str]]:
    """llama.cpp's decode at 1 and 64 streams and its server's mixed-trace tok/s, each with
    where it comes from: measured in this run when the llama_cpp scenario ran, else the
    reference figures (from another day's machine, so only indicative)."""
    measured = (out.get("decode_tok_s_by_batch") or {}).get("llama_cpp") or {}
    server = out["tokens_per_s"].get("llama_cpp_server")
    figures: dict[str, tuple[float | None, str]] = {}
    for b in ("1", "64"):
        figures[b] = ((measured[b], "measured in this run") if b in measured
                      else (LLAMA_CPP_BATCHED_TG[b], "the reference figure"))
    figures["server"] = ((server, "measured in this run") if server is not None
                         else (LLAMA_CPP_SERVER_MIXED_TOK_S, "the reference figure"))
    return figures


def _vs_llama_cpp(value: float | None, factor: float, ref: tuple[float | None, str],
                  note: str) -> dict[str, Any]:
    base, source = ref
    bar = factor * base
    return {"target": f">= {factor} x llama.cpp ({_fmt(base)}, {source}) = {_fmt(bar)} {note}",
            "value": value, "baseline": base, "baseline_source": source,
            "met": None if value is None else bool(value >= bar)}


def assemble(run: BenchContext) -> dict[str, Any]:
    """The JSON document: figures under their keys, absolutes, machine and provenance."""
    res = run.results
    out: dict[str, Any] = {key: None for key in FIGURE_KEYS}
    out.update(tokens_per_s={}, ttft_s={}, itl_s={}, details={}, unavailable={})
    builders = [("capacity", _capacity), ("itl", _itl), ("prefix", _prefix),
                ("sharing", _sharing), ("queue", _queue), ("gateway", _gateway),
                ("structured", _structured)]
    for key, build in builders:
        if key in res:
            build(res, out)
    if "throughput_pagedq" in res or "throughput_hf" in res:
        _throughput(res, out)
    if "decode_pagedq" in res or "decode_hf" in res:
        _decode(res, out)
    for key in FIGURE_KEYS:
        if out[key] is None:
            out["unavailable"][key] = _why_missing(run, key)
    if "llama_cpp" in run.config.scenarios and "llama_cpp" not in res:
        why = run.unavailable.get("llama_cpp") or run.errors.get("llama_cpp")
        out["unavailable"]["llama_cpp"] = (f"unavailable: {why}" if why else "unavailable: it "
                                           "runs with the throughput or decode scenario")
    dec = out["decode_tok_s_by_batch"]
    if dec is not None and (dec["pagedq"] is None or dec["hf_static"] is None):
        side = "pagedq" if dec["pagedq"] is None else "hf_static"
        out["unavailable"][f"decode_tok_s_by_batch.{side}"] = _why_missing(
            run, "decode_tok_s_by_batch")
    out["peak_rss_mb"] = {"pagedq": res.get("peak_rss_mb_pagedq"),
                          "with_hf_baseline": res.get("peak_rss_mb_total"),
                          "note": "bench process peak RSS after the pagedq scenarios, and at the "
                                  "end (which includes the HF model); the Redis worker is a "
                                  "separate process"}
    out["machine"] = machine_info(run)
    out["model"] = res.get("model")
    out["serving_engine"] = res.get("serving_engine")
    out["targets"] = _targets(out)
    out["llama_cpp"] = {k: v for k, v in (res.get("llama_cpp") or {}).items()
                        if k in ("version", "gguf", "threads")} or None
    out["references"] = {
        "llama_cpp_batched_bench_tg_tok_s": LLAMA_CPP_BATCHED_TG,
        "hf_batched_tg_tok_s_reference": HF_BATCHED_TG_REFERENCE,
        "llama_cpp_server_mixed_trace_tok_s": LLAMA_CPP_SERVER_MIXED_TOK_S,
        "hf_static_mixed_trace_tok_s_reference": HF_STATIC_MIXED_TOK_S_REFERENCE,
        "note": "the targets' reference: SmolLM2-135M-Instruct f32 on a 2-core CPU, on another day's "
                "machine; targets use the llama_cpp scenario's figures when it ran",
    }
    out["quant"] = quant_scenario.figures(res.get("quant"))
    if "quant" in run.config.scenarios and out["quant"] is None:
        why = run.unavailable.get("quant") or run.errors.get("quant")
        out["unavailable"]["quant"] = f"unavailable: {why or 'no measurement was produced'}"
    out["spec"] = spec_scenario.figures(res.get("spec"))
    if "spec" in run.config.scenarios and out["spec"] is None:
        why = run.unavailable.get("spec") or run.errors.get("spec")
        out["unavailable"]["spec"] = f"unavailable: {why or 'no measurement was produced'}"
    out["shared"] = shared_cpu.figures(res.get("shared"))
    out["memory"] = memory_bound.figures(res.get("memory"))
    out["config"] = config_record(run.config)
    out["elapsed_s"] = run.elapsed_s
    out["errors"] = run.errors
    return _jsonable(out)


def config_record(config: BenchConfig) -> dict[str, Any]:
    """The run's config as the bench JSON keeps it: the Redis URL's password masked
    (``redact_url``), since the JSON is shared and committed; the user name stays."""
    return {k: redact_url(v) if isinstance(v, str) else v
            for k, v in _jsonable(config.to_dict()).items()}


def _why_missing(run: BenchContext, key: str) -> str:
    if SCENARIO_OF[key] not in run.config.scenarios:
        return f"unavailable: scenario {SCENARIO_OF[key]!r} was not selected (--scenarios)"
    for name in ("setup", *NEEDS[key]):
        if name in run.unavailable:
            return f"unavailable: {run.unavailable[name]}"
        if name in run.errors:
            return f"unavailable: scenario {name!r} failed: {run.errors[name]}"
    return "unavailable: no measurement was produced (see the log)"


def _jsonable(value: Any) -> Any:
    """Plain JSON types: numpy scalars/arrays, tuples and NaN/inf (-> null) converted."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return None
    if hasattr(value, "__dataclass_fields__"):
        return _jsonable(asdict(value))
    return value


def write_json(doc: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return path


# -- the terminal table ------------------------------------------------------------------------
def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def table(doc: dict[str, Any]) -> str:
    """Figure | pagedq | baseline | ratio | target, one line each (the README table's shape)."""
    det = doc["details"]
    cap = det.get("capacity", {})
    tput, itl, pfx = det.get("throughput", {}), det.get("itl", {}), det.get("prefix", {})
    tps = doc["tokens_per_s"]
    tg = doc["targets"]
    rows = [
        ("KV utilization", doc["kv_utilization"], doc["kv_utilization_contiguous"],
         None, tg["kv_utilization"]["target"]),
        ("peak concurrent seqs (equal KV)", cap.get("paged_peak_running"),
         cap.get("reserved_peak_running"), doc["concurrency_vs_contiguous"],
         tg["concurrency_vs_contiguous"]["target"]),
        ("output tok/s, trace vs HF static", tps.get("pagedq"), tps.get("hf_static"),
         doc["throughput_vs_hf_static"], tg["throughput_vs_hf_static"]["target"]),
        ("ITL p99/p50, chunked vs unchunked", doc["itl_p99_over_p50_chunked"],
         doc["itl_p99_over_p50_unchunked"], None, tg["itl_p99_over_p50_chunked"]["target"]),
        ("TTFT s, 1k prefix cached vs cold", pfx.get("ttft_cached_median_s"),
         pfx.get("ttft_cold_median_s"), doc["prefix_ttft_ratio"],
         tg["prefix_ttft_ratio"]["target"]),
        ("tok/s via Redis vs in-process", tps.get("pagedq_via_redis"), _queue_baseline(doc),
         doc["queue_throughput_vs_inprocess"], tg["queue_throughput_vs_inprocess"]["target"]),
        ("tok/s via HTTP gateway vs SDK", tps.get("pagedq_via_gateway"),
         ((doc.get("details") or {}).get("gateway") or {}).get("sdk_tok_s_baseline"),
         doc.get("gateway_throughput_vs_sdk"), tg["gateway_throughput_vs_sdk"]["target"]),
        ("added p50 TTFT ms, HTTP vs SDK", doc.get("gateway_added_ttft_p50_ms"), None, None,
         tg["gateway_added_ttft_p50_ms"]["target"]),
        ("output tok/s, trace vs llama-server", tps.get("pagedq"), tps.get("llama_cpp_server"),
         _ratio(tps.get("pagedq"), tps.get("llama_cpp_server")),
         tg["mixed_trace_tok_s"]["target"]),
        ("tok/s, JSON schema vs unconstrained", tps.get("structured_json"),
         tps.get("structured_free_same_lengths"), doc.get("structured_throughput_ratio"),
         tg.get("structured_throughput_ratio", {}).get("target")),
    ]
    dec = doc.get("decode_tok_s_by_batch") or {}
    for series, label in _pagedq_series(dec):
        tag = f" ({label})" if label else ""
        for b in dec[series]:
            hf = (dec.get("hf_static") or {}).get(b)
            rows.append((f"decode tok/s, batch {b}{tag}", dec[series][b], hf,
                         _ratio(dec[series][b], hf), _llama_cpp_cell(dec, b)))
    head = f"{'figure':36} {'pagedq':>10} {'baseline':>10} {'ratio':>8}  target"
    lines = [head, "-" * len(head)]
    for name, ours, base, ratio, target in rows:
        lines.append(f"{name:36} {_fmt(ours):>10} {_fmt(base):>10} {_fmt(ratio):>8}  {target}")
    if tput.get("greedy_agreement_pagedq_vs_hf"):
        agree = tput["greedy_agreement_pagedq_vs_hf"]["requests_identical"]
        lines.append(f"(greedy outputs identical to HF for {agree:.0%} of trace requests)")
    if itl:
        lines.append("(ITL: decodes running while a long prompt arrives; details in the JSON)")
    if doc.get("quant"):
        lines.append(quant_scenario.table(doc["quant"]))
    if doc.get("spec"):
        lines.append(spec_scenario.markdown(doc["spec"]))
    if doc.get("shared"):
        lines.append(shared_cpu.markdown(doc["shared"]))
    if doc.get("memory"):
        lines.append(memory_bound.markdown(doc["memory"]))
    for key, why in doc["unavailable"].items():
        lines.append(f"{key}: {why}")
    for key, why in doc["errors"].items():
        lines.append(f"ERROR in {key}: {why}")
    return "\n".join(lines)


def _llama_cpp_cell(dec: dict[str, Any], b: str) -> str:
    """llama.cpp's decode tok/s at batch b: this run's when measured, else the reference."""
    measured = (dec.get("llama_cpp") or {}).get(b)
    if measured is not None:
        return f"llama.cpp (this run): {_fmt(measured)}"
    return f"llama.cpp (reference): {_fmt(LLAMA_CPP_BATCHED_TG.get(b))}"


def markdown(doc: dict[str, Any]) -> str:
    """The README's "traditional vs paged" table, filled from a run's JSON."""
    det = doc["details"]
    cap, pfx = det.get("capacity", {}), det.get("prefix", {})
    itl = det.get("itl", {})
    tps = doc["tokens_per_s"]
    tg = doc["targets"]

    def met(key: str) -> str:
        flag = tg[key]["met"]
        return "n/a" if flag is None else ("yes" if flag else "**no**")

    def itl_ms(mode: str) -> str:
        s = itl.get(mode, {}).get("itl_s", {})
        if not s or s.get("p50") is None:
            return "n/a"
        return f"p50 {_fmt(s['p50'] * 1000)} ms, p99 {_fmt(s['p99'] * 1000)} ms"

    rows = [
        ("KV utilization (live / allocated slots)", "max-length reservation",
         _fmt(doc["kv_utilization_contiguous"]), _fmt(doc["kv_utilization"]), "",
         tg["kv_utilization"]["target"], met("kv_utilization")),
        ("Concurrent sequences at equal KV memory", "max-length reservation",
         _fmt(cap.get("reserved_peak_running")), _fmt(cap.get("paged_peak_running")),
         _fmt(doc["concurrency_vs_contiguous"]), ">= " + _fmt(cap.get("concurrency_target")),
         met("concurrency_vs_contiguous")),
        ("Output tokens/s, mixed trace", "HF generate, static batches",
         _fmt(tps.get("hf_static")), _fmt(tps.get("pagedq")), _fmt(doc["throughput_vs_hf_static"]),
         ">= 4", met("throughput_vs_hf_static")),
        ("ITL p99/p50 while a long prompt arrives", "unchunked prefill",
         f"{_fmt(doc['itl_p99_over_p50_unchunked'])} ({itl_ms('unchunked')})",
         f"{_fmt(doc['itl_p99_over_p50_chunked'])} ({itl_ms('chunked')})", "", "<= 2",
         met("itl_p99_over_p50_chunked")),
        ("TTFT with a 1k-token prefix cached (s)", "cold",
         _fmt(pfx.get("ttft_cold_median_s")), _fmt(pfx.get("ttft_cached_median_s")),
         _fmt(doc["prefix_ttft_ratio"]), "<= 0.2", met("prefix_ttft_ratio")),
        ("Output tokens/s through Redis", "in-process engine (runs before and after)",
         _fmt(_queue_baseline(doc)),
         _fmt(tps.get("pagedq_via_redis")), _fmt(doc["queue_throughput_vs_inprocess"]),
         ">= 0.95", met("queue_throughput_vs_inprocess")),
    ]
    dec = doc.get("decode_tok_s_by_batch") or {}
    for series, label in _pagedq_series(dec):
        tag = f", {label}" if label else ""
        for b in dec[series]:
            hf = (dec.get("hf_static") or {}).get(b)
            rows.append((f"Decode tokens/s, batch of {b}{tag}", "HF generate", _fmt(hf),
                         _fmt(dec[series][b]), _fmt(_ratio(dec[series][b], hf)),
                         _llama_cpp_cell(dec, b), ""))
    like = judged_series(dec)
    tag = f", {like.removeprefix('pagedq_')}" if like != "pagedq" else ""
    for key, figure, baseline in (
            ("decode_1_stream_tok_s", f"Decode tokens/s, batch of 1{tag}", "llama-batched-bench"),
            ("decode_64_streams_tok_s", f"Decode tokens/s, batch of 64{tag}",
             "llama-batched-bench"),
            ("mixed_trace_tok_s", "Output tokens/s, mixed trace",
             "llama-server (continuous batching)")):
        t = tg[key]
        if t["baseline_source"] == "measured in this run":
            rows.append((figure, baseline, _fmt(t["baseline"]), _fmt(t["value"]),
                         _fmt(_ratio(t["value"], t["baseline"])), f">= {LLAMA_CPP_FACTORS[key]}x",
                         met(key)))
    lines = ["| Figure | Baseline | Baseline value | pagedq | Ratio | Target | Met |",
             "|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    m = doc["machine"]
    lines.append("")
    lines.append(f"Measured on {m.get('cpu_model')} ({m.get('cpu_affinity_cores')} cores, "
                 f"ISA level {m.get('cpu_isa_used')} of {', '.join(m.get('cpu_isa_levels') or [])}, "
                 f"streaming read {m.get('stream_read_gbps')} GB/s, "
                 f"{m.get('torch_threads')} torch threads, {m.get('device')}), model "
                 f"{(doc.get('model') or {}).get('architecture')} {doc['config'].get('dtype')}, "
                 f"profile {doc['config'].get('profile')}, torch {m.get('torch')}.")
    for key, why in doc["unavailable"].items():
        lines.append(f"- `{key}`: {why}")
    if doc.get("quant"):
        lines += ["", quant_scenario.markdown(doc["quant"])]
    if doc.get("spec"):
        lines += ["", spec_scenario.markdown(doc["spec"])]
    if doc.get("shared"):
        lines += ["", shared_cpu.markdown(doc["shared"])]
    if doc.get("memory"):
        lines += ["", memory_bound.markdown(doc["memory"])]
    return "\n".join(lines) + "\n"


# -- plots --------------------------------------------------------------------------------------
def plot(run: BenchContext, doc: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """PNG charts for the README; each is skipped when its scenario did not run."""
    # matplotlib: optional (the bench extra), needed only when charts are drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use(): pyplot takes its backend on import

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, draw in (("kv_occupancy.png", _plot_kv), ("itl_distribution.png", _plot_itl),
                       ("throughput_vs_concurrency.png", _plot_decode)):
        fig = draw(plt, run, doc)
        if fig is None:
            continue
        path = out / name
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def _plot_kv(plt: Any, run: BenchContext, doc: dict[str, Any]) -> Any:
    cap = run.results.get("capacity")
    if cap is None:
        return None
    paged, sim = cap["run"], cap["sim"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6))
    t = [s.t for s in paged.samples]
    top.fill_between(t, [s.blocks_used * paged.block_size for s in paged.samples], step="post",
                     alpha=0.3, label="allocated slots (blocks x block size)")
    top.step(t, [s.tokens_live for s in paged.samples], where="post", label="live tokens")
    top.axhline(cap["budget_tokens"], color="k", ls="--", lw=1, label="KV budget")
    util = doc["kv_utilization"]
    top.set_title(f"paged (measured): utilization {_fmt(util)}, "
                  f"peak {paged.peak_running()} sequences")
    top.set_xlabel("seconds")
    top.set_ylabel("KV token slots")
    top.legend(loc="upper right", fontsize=8)
    steps = [s.step for s in sim.steps]
    bottom.fill_between(steps, [s.slots_reserved for s in sim.steps], step="post", alpha=0.3,
                        color="tab:red", label="reserved slots (max_model_len each)")
    bottom.step(steps, [s.tokens_live for s in sim.steps], where="post", color="tab:red",
                label="live tokens")
    bottom.axhline(cap["budget_tokens"], color="k", ls="--", lw=1, label="KV budget")
    bottom.set_title(f"max-length reservation (simulated, same trace and budget): utilization "
                     f"{_fmt(doc['kv_utilization_contiguous'])}, peak {sim.peak_running()}")
    bottom.set_xlabel("engine steps")
    bottom.set_ylabel("KV token slots")
    bottom.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig


def _plot_itl(plt: Any, run: BenchContext, doc: dict[str, Any]) -> Any:
    itl = run.results.get("itl")
    if itl is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    for mode, color in (("chunked", "tab:blue"), ("unchunked", "tab:red")):
        values = np.sort(itl[mode]["itls"]) * 1000
        if values.size == 0:
            continue
        frac = np.arange(1, values.size + 1) / values.size
        ratio = doc[f"itl_p99_over_p50_{mode}"]
        ax.step(values, frac, where="post", color=color,
                label=f"{mode} prefill: p99/p50 = {_fmt(ratio)}")
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency of running decodes (ms, log scale)")
    ax.set_ylabel("fraction of tokens")
    ax.set_title(f"decodes while a {run.config.itl_long_prompt_tokens}-token prompt arrives")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def _plot_decode(plt: Any, run: BenchContext, doc: dict[str, Any]) -> Any:
    dec = doc.get("decode_tok_s_by_batch")
    if not dec:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    series = [("pagedq", dec.get("pagedq"), "o-"), ("HF generate (static batch)",
                                                    dec.get("hf_static"), "s-")]
    series += [(f"pagedq, {label} cache", dec[k], "o:") for k, label in _pagedq_series(dec)
               if label]
    if dec.get("llama_cpp"):
        series.append(("llama.cpp llama-batched-bench (this run)", dec["llama_cpp"], "x-"))
    elif run.config.model is None and run.config.device in (None, "cpu"):
        series.append(("llama.cpp (reference)", dec.get("llama_cpp_reference"), "x--"))
    for label, values, style in series:
        if values:
            xs = sorted(int(b) for b in values)
            ax.plot(xs, [values[str(b)] for b in xs], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(run.config.decode_batches), [str(b) for b in run.config.decode_batches])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"decode throughput vs concurrency ({run.config.decode_prompt_tokens}-token "
                 f"prompts, {run.config.decode_new_tokens} new tokens, greedy)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
