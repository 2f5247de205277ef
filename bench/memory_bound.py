"""The ``memory`` scenario: decode on a model too big for any cache, against llama.cpp and the
roofline.

Why: the bundled 135M model nearly fits in a server CPU's caches, so its figures flatter every
engine; users run 1-8B models, whose decode is bound by the memory's streaming bandwidth. This
scenario writes a model of SmolLM2-1.7B's shape (hidden 2048, 24 layers, 32 heads, intermediate
8192, SmolLM2's tokenizer and template from the bundled file) with random weights as an F16
GGUF, quantizes it to Q8_0 and Q4_K_M with ``llama-quantize`` (speed does not depend on the
weights' values; both cached), and measures decode tok/s at 1 and 16 streams:

- pagedq serving the file packed, llama.cpp's ``llama-batched-bench`` on the same file, two
  sweeps each, alternated, best of each (the quant scenario's method);
- the roofline: the bandwidth measured in the same run (:mod:`.bandwidth`) ÷ the bytes of
  weights a token reads (the engine's resident weight bytes).

Targets: >= llama.cpp, and >= 0.8 of the roofline at one stream.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedq.bench import llama_cpp, quant_scenario, scenarios
from pagedq.bench.bandwidth import stream_read_gbps
from pagedq.bench.context import Unavailable
from pagedq.logging import get_logger

log = get_logger("pagedq.bench.memory")

SHAPE = {"hidden": 2048, "layers": 24, "heads": 32, "kv_heads": 32, "intermediate": 8192}
TYPES = ("Q8_0", "Q4_K_M")
STREAMS = (1, 16)
TARGETS = {"vs_llama_cpp": 1.0, "roofline_1": 0.8}
COPIED = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
          "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
          "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
          "tokenizer.ggml.padding_token_id", "tokenizer.chat_template",
          "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix")


def synthetic_f16(path: Path, seed: int = 0, shape: dict[str, int] = SHAPE) -> Path:
    """A random model of ``shape`` (default: SmolLM2-1.7B's) as an F16 GGUF, written once
    (3.4 GB at the default shape)."""
    # the engine side is lazy in bench/: see context.py's setup
    import gguf

    from pagedq.worker.models.default_model import default_gguf

    if path.is_file():
        return path
    source = gguf.GGUFReader(str(default_gguf()))
    h, n_layers, inter = shape["hidden"], shape["layers"], shape["intermediate"]
    vocab = int(source.fields["llama.vocab_size"].contents())
    writer = gguf.GGUFWriter(str(path.with_suffix(".tmp")), "llama")
    writer.add_name("pagedq memory-bound bench model (SmolLM2-1.7B shape, random weights)")
    writer.add_block_count(n_layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_freq_base(130000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(h // shape["heads"])
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _copy_tokenizer(source, writer)
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", matrix(vocab, h))
    writer.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for i in range(n_layers):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", matrix(h, h))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", matrix(inter, h))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", matrix(inter, h))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", matrix(h, inter))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.with_suffix(".tmp").rename(path)
    return path


def _copy_tokenizer(source: Any, writer: Any) -> None:
    """SmolLM2's tokenizer and chat template, field by field, from the bundled GGUF."""
    # the engine side is lazy in bench/: see context.py's setup
    import gguf

    for key in COPIED:
        field = source.fields.get(key)
        if field is None:
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(key, value)
        elif kind == gguf.GGUFValueType.BOOL:
            writer.add_bool(key, bool(value))
        else:
            writer.add_uint32(key, int(value))


def files(cpp: llama_cpp.LlamaCpp) -> dict[str, Path]:
    # the engine side is lazy in bench/: see context.py's setup
    from pagedq.worker.models.model_cache import cache_dir

    folder = cache_dir() / "memory_bound"
    folder.mkdir(parents=True, exist_ok=True)
    f16 = synthetic_f16(folder / "smollm2-1.7b-shape.F16.gguf")
    out = {}
    for type_name in TYPES:
        target = folder / f"smollm2-1.7b-shape.{type_name}.gguf"
        if not target.is_file():
            quant_scenario.requantize(cpp, f16, target, type_name)
        out[type_name] = target
    return out


def measure(run: Any) -> None:
    c = run.config
    try:
        cpp = llama_cpp.LlamaCpp.locate(c.llama_cpp)
    except llama_cpp.LlamaCppUnavailable as exc:
        raise Unavailable(f"the memory scenario needs llama-quantize: {exc}") from exc
    threads = c.num_threads or torch.get_num_threads()
    results: dict[str, Any] = {"shape": SHAPE, "streams": list(STREAMS),
                               "stream_read_gbps": stream_read_gbps(threads), "files": {}}
    for type_name, path in files(cpp).items():
        engine = run.engine(model=str(path), quantization="auto", num_kv_blocks=1024,
                            max_num_seqs=max(STREAMS))
        ours, theirs = [], []
        for _ in range(2):
            ours.append(scenarios.decode_rows(run, engine, batches=STREAMS))
            theirs.append(llama_cpp.batched_bench(cpp, path, c.decode_prompt_tokens,
                                                  c.decode_new_tokens, STREAMS, threads,
                                                  no_repack=not llama_cpp.repacks(cpp)))
        weight_bytes = engine.stats()["weight_bytes"]
        del engine
        results["files"][type_name] = {
            "gguf": str(path), "file_bytes": path.stat().st_size, "weight_bytes": weight_bytes,
            "pagedq": quant_scenario.best_rows(ours), "llama_cpp": quant_scenario.best_rows(theirs),
            "roofline_tok_s_1": results["stream_read_gbps"] * 1e9 / weight_bytes}
    run.results["memory"] = results


def figures(results: dict[str, Any] | None) -> dict[str, Any] | None:
    if not results:
        return None
    out: dict[str, Any] = {"stream_read_gbps": results["stream_read_gbps"], "files": {}}
    for type_name, f in results["files"].items():
        # string keys: the figures go through JSON, which keeps no int keys
        ours = {str(int(r["b"])): r["s_tg"] for r in f["pagedq"]}
        theirs = {str(int(r["b"])): r["s_tg"] for r in f["llama_cpp"]}
        out["files"][type_name] = {
            "pagedq": ours, "llama_cpp": theirs, "roofline_tok_s_1": f["roofline_tok_s_1"],
            "vs_llama_cpp": {s: ours[s] / theirs[s] for s in ours if theirs.get(s)},
            "of_roofline_1": ours["1"] / f["roofline_tok_s_1"], "weight_bytes": f["weight_bytes"]}
    return out


def markdown(figs: dict[str, Any] | None) -> str:
    if not figs:
        return ""
    rows = [f"Memory-bound decode (SmolLM2-1.7B shape, random weights; streaming read "
            f"{figs['stream_read_gbps']:.1f} GB/s):", "",
            "| file | weights | pagedq 1 / 16 streams | llama.cpp 1 / 16 | ratio 1 / 16 | "
            "roofline at 1 | pagedq of roofline |", "|---|---|---|---|---|---|---|"]
    for type_name, f in figs["files"].items():
        p, q, r = f["pagedq"], f["llama_cpp"], f["vs_llama_cpp"]
        rows.append(f"| {type_name} | {f['weight_bytes'] / 1e9:.2f} GB | {p['1']:.1f} / {p['16']:.1f} | "
                    f"{q.get('1', 0):.1f} / {q.get('16', 0):.1f} | {r.get('1', 0):.2f}x / "
                    f"{r.get('16', 0):.2f}x | {f['roofline_tok_s_1']:.1f} | "
                    f"{f['of_roofline_1']:.2f} |")
    return "\n".join(rows)
