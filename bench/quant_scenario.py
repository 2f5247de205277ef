"""The ``quant`` scenario: pagedq serving GGUF files as shipped (blocks kept packed) against
llama.cpp on the very same files, in the same run.

Files: the default model's bundled Q4_1, plus Q8_0 and Q4_K_M that ``llama-quantize`` makes from
its F32 dequantization (cached beside the F32 file); a run with its own GGUF model uses that file
alone. For each file:

- decode tok/s at each of ``decode_batches`` streams: pagedq's decode sweep and
  ``llama-batched-bench`` with its defaults (weights repacked for the CPU), except ``-nr`` on
  AMX CPUs, where build 11434 crashes in its AMX repack path on every quantized type (the JSON
  says which ran: ``llama_cpp.repack``), ``quant_repeats`` sweeps each, alternated, best of each;
- the mixed (throughput) trace: pagedq in process and ``llama-server`` (the same repack rule);
- resident weight bytes (``engine.stats()["weight_bytes"]``) against the file's size;
- fidelity: greedy continuations of fixed prompts against the dequantized model
  (``quantization="none"``: the same file widened to fp32), mean matching prefix.

Without the llama.cpp binaries the pagedq side is still measured and the comparisons say why
they are missing. Targets, per type: >= 1.1x llama.cpp at 1 stream, >= 2x at 64 streams,
>= 1.5x llama-server on the mixed trace, weights <= 1.1x the file, matching prefix >= 0.9
(8-bit) / 0.8 (4-bit).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import torch

from pagedq.bench import driver, fidelity, llama_cpp, scenarios
from pagedq.bench.context import Unavailable
from pagedq.logging import get_logger

log = get_logger("pagedq.bench.quant")

EIGHT_BIT = ("Q8_0",)  # GGML types judged by the 8-bit fidelity target
TARGETS = {"decode_1": 1.1, "decode_64": 2.0, "mixed": 1.5, "weights_vs_file": 1.1,
           "prefix_8bit": 0.9, "prefix_4bit": 0.8}


def quantize_gguf(cpp: llama_cpp.LlamaCpp, f32: Path, type_name: str) -> Path:
    """``f32`` quantized to ``type_name`` by llama-quantize (built once, cached beside it)."""
    out = f32.with_name(f32.name.replace(".F32.gguf", f".{type_name}.gguf"))
    if not out.is_file():
        requantize(cpp, f32, out, type_name)
    return out


def requantize(cpp: llama_cpp.LlamaCpp, source: Path, out: Path, type_name: str) -> None:
    """``source`` written as ``type_name`` to ``out`` by llama-quantize (via a temporary file:
    an interrupted run leaves no half file behind)."""
    tmp = out.with_suffix(".tmp")
    proc = subprocess.run([cpp.exe("llama-quantize"), str(source), str(tmp), type_name],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not tmp.is_file():
        raise RuntimeError(f"llama-quantize could not write {type_name} from {source}: "
                           f"{(proc.stderr or proc.stdout).strip()[-600:]}")
    tmp.rename(out)


def files(run: Any, cpp: llama_cpp.LlamaCpp | None) -> dict[str, Path]:
    """The GGUF files to serve, by type name."""
    # the engine side is lazy in bench/: see context.py's setup
    from pagedq.worker.models.default_model import default_gguf
    from pagedq.worker.models.model_cache import cache_dir

    c = run.config
    if c.model is not None:
        path = Path(c.model).expanduser()
        if path.suffix.lower() != ".gguf":
            raise Unavailable("the quant scenario serves GGUF files: run it with the default "
                                  "model or --model FILE.gguf")
        return {path.stem: path}
    bundled = default_gguf()
    out = {"Q4_1": bundled}
    wanted = [t for t in c.quant_types if t != "Q4_1"]
    if wanted and cpp is None:
        log.warning("quant files beyond the bundled Q4_1 need llama-quantize", skipped=wanted)
        return out
    if wanted:
        f32 = llama_cpp.f32_gguf(cpp, bundled, cache_dir() / "llama_cpp")
        out.update({t: quantize_gguf(cpp, f32, t) for t in wanted})
    return {t: p for t, p in out.items() if t in c.quant_types}


def mostly_eight_bit(path: Path) -> bool:
    """Whether most of the file's tensor bytes are in an 8-bit type (else 4-bit's target)."""
    # the engine side is lazy in bench/: see context.py's setup
    from gguf import GGUFReader

    by_type: dict[str, int] = {}
    for tensor in GGUFReader(str(path)).tensors:
        by_type[tensor.tensor_type.name] = by_type.get(tensor.tensor_type.name, 0) + tensor.n_bytes
    eight = sum(n for t, n in by_type.items() if t in EIGHT_BIT)
    return eight > sum(by_type.values()) / 2


def measure(run: Any) -> None:
    """Every file through pagedq, then (when its binaries are there) through llama.cpp."""
    c = run.config
    try:
        cpp = llama_cpp.LlamaCpp.locate(c.llama_cpp)
        cpp_why = None
    except llama_cpp.LlamaCppUnavailable as exc:
        cpp, cpp_why = None, str(exc)
    results: dict[str, Any] = {"llama_cpp_unavailable": cpp_why, "files": {}}
    if cpp is not None:
        results["llama_cpp_version"] = cpp.version()
    for type_name, path in files(run, cpp).items():
        log.info("quant scenario", type=type_name, gguf=str(path))
        ours, theirs = pagedq_side(run, path, cpp)
        entry = {"gguf": str(path), "file_bytes": path.stat().st_size,
                 "eight_bit": mostly_eight_bit(path), **ours}
        if cpp is not None:
            entry["llama_cpp"] = {**theirs, **llama_cpp_side(run, cpp, path)}
        results["files"][type_name] = entry
    run.results["quant"] = results


def best_rows(sweeps: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Per stream count, the sweep row with the most decode tok/s."""
    return [max(rows, key=lambda r: r["s_tg"]) for rows in zip(*sweeps, strict=True)]


def decode_sweeps(run: Any, engine: Any, cpp: llama_cpp.LlamaCpp | None,
                  path: Path) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """``quant_repeats`` decode sweeps of each engine, alternated, the best of each kept: on a
    shared machine other work only ever slows a sweep, and it slows the two engines unevenly."""
    c = run.config
    threads = c.num_threads or torch.get_num_threads()
    ours, theirs, error = [], [], None
    for _ in range(max(1, c.quant_repeats)):
        ours.append(scenarios.decode_rows(run, engine))
        if cpp is None or error:
            continue
        try:
            theirs.append(llama_cpp.batched_bench(
                cpp, path, c.decode_prompt_tokens, c.decode_new_tokens, c.decode_batches, threads,
                no_repack=not llama_cpp.repacks(cpp)))
        except RuntimeError as exc:
            error = str(exc)
    cpp_out: dict[str, Any] = {"threads": threads, "decode_sweeps": len(theirs),
                               "repack": cpp is not None and llama_cpp.repacks(cpp)}
    if theirs:
        cpp_out["decode_rows"] = best_rows(theirs)
    if error:
        cpp_out["decode_error"] = error
    return best_rows(ours), cpp_out


def pagedq_side(run: Any, path: Path,
                cpp: llama_cpp.LlamaCpp | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Decode sweeps (llama.cpp's alternated with them), mixed trace, resident weights and
    fidelity of pagedq on one file; and llama.cpp's decode figures."""
    # the engine side is lazy in bench/: see context.py's setup
    from pagedq.worker import Engine

    c = run.config
    engine = run.engine(model=str(path), quantization="auto", **run.serving_engine_kwargs())
    ours, theirs = decode_sweeps(run, engine, cpp, path)
    out: dict[str, Any] = {"weight_bytes": engine.stats()["weight_bytes"], "decode_rows": ours,
                           "decode_sweeps": max(1, c.quant_repeats)}
    trace = run.throughput_trace()
    out["mixed_tok_s"] = driver.serve(engine, trace).timeline.tokens_per_s
    prompts = fidelity.PROMPTS
    packed = fidelity.greedy(engine, prompts, c.quant_fidelity_tokens)
    packed_ppl = fidelity.perplexity(engine)
    del engine
    twin = Engine(config=c.engine_config(model=str(path), quantization="none", num_kv_blocks=1024))
    widened = fidelity.greedy(twin, prompts, c.quant_fidelity_tokens)
    out["mean_matching_prefix"] = fidelity.mean_matching_prefix(packed, widened)
    out["perplexity"] = {"packed": packed_ppl, "dequantized": fidelity.perplexity(twin)}
    out["fidelity"] = {"prompts": len(prompts), "new_tokens": c.quant_fidelity_tokens,
                       "reference": "the same file dequantized to fp32 (quantization='none')"}
    return out, theirs


def llama_cpp_side(run: Any, cpp: llama_cpp.LlamaCpp, path: Path) -> dict[str, Any]:
    """llama-server on the mixed trace (the decode sweeps are decode_sweeps')."""
    c = run.config
    threads = c.num_threads or torch.get_num_threads()
    out: dict[str, Any] = {}
    try:
        served = llama_cpp.serve_trace(cpp, path, run.throughput_trace(), c.llama_cpp_server_slots,
                                       c.max_model_len, threads, c.queue_timeout_s,
                                       no_repack=not llama_cpp.repacks(cpp))
        out["mixed_tok_s"] = served["tokens_per_s"]
    except RuntimeError as exc:
        out["mixed_error"] = str(exc)
    return out


# -- figures --------------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def figures(results: dict[str, Any] | None) -> dict[str, Any] | None:
    """Per file: pagedq and llama.cpp figures, their ratios and each target's verdict."""
    if not results:
        return None
    out: dict[str, Any] = {"llama_cpp_version": results.get("llama_cpp_version"),
                           "llama_cpp_unavailable": results.get("llama_cpp_unavailable"),
                           "targets": TARGETS, "files": {}}
    for type_name, entry in results["files"].items():
        ours = {str(r["b"]): r["s_tg"] for r in entry["decode_rows"]}
        cpp = entry.get("llama_cpp") or {}
        theirs = {str(r["b"]): r["s_tg"] for r in cpp.get("decode_rows") or []}
        weights_ratio = entry["weight_bytes"] / entry["file_bytes"]
        prefix_target = TARGETS["prefix_8bit" if entry["eight_bit"] else "prefix_4bit"]
        ratios = {
            "decode_1": _ratio(ours.get("1"), theirs.get("1")),
            "decode_64": _ratio(ours.get("64"), theirs.get("64")),
            "mixed": _ratio(entry["mixed_tok_s"], cpp.get("mixed_tok_s")),
        }
        met = {k: None if v is None else v >= TARGETS[k] for k, v in ratios.items()}
        met["weights_vs_file"] = weights_ratio <= TARGETS["weights_vs_file"]
        met["mean_matching_prefix"] = entry["mean_matching_prefix"] >= prefix_target
        out["files"][type_name] = {
            "gguf": entry["gguf"], "file_bytes": entry["file_bytes"],
            "weight_bytes": entry["weight_bytes"], "weights_vs_file": weights_ratio,
            "decode_tok_s": {"pagedq": ours, "llama_cpp": theirs or None},
            "mixed_tok_s": {"pagedq": entry["mixed_tok_s"], "llama_server": cpp.get("mixed_tok_s")},
            "ratios": ratios, "mean_matching_prefix": entry["mean_matching_prefix"],
            "perplexity": entry.get("perplexity"),
            "prefix_target": prefix_target, "met": met,
            "errors": {k: v for k, v in cpp.items() if k.endswith("_error")} or None,
            "llama_cpp_repack": cpp.get("repack"),
        }
    return out


def table(figs: dict[str, Any] | None) -> str:
    """One block of lines per file: decode by streams, mixed trace, weights, fidelity."""
    if not figs:
        return ""

    def fmt(v: Any) -> str:
        return "-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))

    def verdict(flag: bool | None) -> str:
        return "n/a" if flag is None else ("met" if flag else "NOT met")

    lines = [f"quant: GGUF files as shipped, pagedq vs llama.cpp "
             f"({figs.get('llama_cpp_version') or figs.get('llama_cpp_unavailable')})"]
    for type_name, f in figs["files"].items():
        dec = f["decode_tok_s"]
        theirs = dec["llama_cpp"] or {}
        for b, tok_s in dec["pagedq"].items():
            lines.append(f"  {type_name:7} decode tok/s, {b:>2} streams: pagedq {fmt(tok_s)} "
                         f"llama.cpp {fmt(theirs.get(b))} ratio {fmt(_ratio(tok_s, theirs.get(b)))}")
        mix = f["mixed_tok_s"]
        lines.append(f"  {type_name:7} mixed trace tok/s: pagedq {fmt(mix['pagedq'])} llama-server "
                     f"{fmt(mix['llama_server'])} ratio {fmt(f['ratios']['mixed'])}")
        lines.append(f"  {type_name:7} weights {f['weight_bytes'] / 1e6:.1f} MB, file "
                     f"{f['file_bytes'] / 1e6:.1f} MB ({f['weights_vs_file']:.3f}x); greedy mean "
                     f"matching prefix vs dequantized {f['mean_matching_prefix']:.3f}")
        if f.get("perplexity"):
            ppl = f["perplexity"]
            lines.append(f"  {type_name:7} teacher-forced perplexity: packed {ppl['packed']:.3f}, "
                         f"dequantized {ppl['dequantized']:.3f}")
        lines.append("  " + " ".join(f"{k}: {verdict(v)};" for k, v in f["met"].items()))
    return "\n".join(lines)


def markdown(figs: dict[str, Any] | None) -> str:
    """docs/quantization.md's table: per file, pagedq / llama.cpp decode tok/s by streams, the
    mixed trace against llama-server, resident weights over file size, matching prefix."""
    if not figs:
        return ""

    def pair(ours: float | None, theirs: float | None) -> str:
        cell = " / ".join("-" if v is None else f"{v:.3g}" for v in (ours, theirs))
        ratio = _ratio(ours, theirs)
        return cell if ratio is None else f"{cell} ({ratio:.2f}x)"

    streams = sorted({b for f in figs["files"].values() for b in f["decode_tok_s"]["pagedq"]},
                     key=int)
    lines = ["| type | " + " | ".join(f"decode tok/s, {b} stream{'s' * (b != '1')} "
                                      "(pagedq / llama.cpp)" for b in streams)
             + " | mixed trace (pagedq / llama-server) | weights / file | matching prefix |",
             "|---" * (len(streams) + 4) + "|"]
    for type_name, f in figs["files"].items():
        dec, theirs = f["decode_tok_s"], f["decode_tok_s"]["llama_cpp"] or {}
        cells = [pair(dec["pagedq"].get(b), theirs.get(b)) for b in streams]
        mix = f["mixed_tok_s"]
        cells += [pair(mix["pagedq"], mix["llama_server"]), f"{f['weights_vs_file']:.3f}",
                  f"{f['mean_matching_prefix']:.3f}"]
        lines.append(f"| {type_name} | " + " | ".join(cells) + " |")
    lines.append("")
    repacked = {f.get("llama_cpp_repack") for f in figs["files"].values()} - {None}
    how = ("with its default weight repacking" if repacked == {True} else
           "with `-nr` (no weight repacking: build 11434 crashes repacking on AMX)"
           if repacked == {False} else "")
    lines.append(f"llama.cpp: {figs.get('llama_cpp_version') or figs.get('llama_cpp_unavailable')}"
                 + (f", run {how}." if how else "."))
    return "\n".join(lines) + "\n"
