"""``pagedq plan``: the KV cache arithmetic for a model, printed without loading its weights.

Memory = weights + KV cache + activations; KV bytes per token = 2 (K and V) x layers x KV
heads x head dim x bytes per element. The plan prints each factor, what N concurrent jobs of
L tokens need, and what the engine's default budget buys on this machine.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path
from typing import Any

from pagedq.errors import PagedQError
from pagedq.worker.cli.console import setup_console_logging
from pagedq.worker.config import EngineConfig, default_device
from pagedq.worker.config_flags import add_engine_flags, add_log_level_flag, engine_knobs

GiB = 1 << 30


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="size the KV cache for N concurrent jobs (no weights loaded)",
                       description="Print a model's KV bytes per token, what N concurrent jobs "
                       "of L tokens need, and what the default KV budget holds here. Reads the "
                       "model's config only.")
    p.add_argument("--concurrency", type=int, default=32, metavar="N",
                   help="jobs running at once (default: 32)")
    p.add_argument("--seq-len", type=int, default=1024, metavar="L",
                   help="tokens per job, prompt + output (default: 1024)")
    add_log_level_flag(p)  # INFO: a wait longer than 2 s (imports, a first conversion) shows
    add_engine_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedq.logging import get_logger  # structlog: ~0.2 s on `pagedq --help`
    from pagedq.progress import waiting  # the same

    setup_console_logging(args.log_level)
    try:
        if args.concurrency < 1 or args.seq_len < 1:
            raise PagedQError("--concurrency and --seq-len must be at least 1")
        config = EngineConfig(**engine_knobs(args))
        with waiting("reading the model's config (torch loads first)", get_logger("pagedq.plan"),
                     model=config.model or "default"):
            text = plan_text(config, args.concurrency, args.seq_len)
        print(text)
    except PagedQError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def plan_text(config: Any, jobs: int, seq_len: int) -> str:
    # torch and transformers (seconds): `pagedq --help`, submit and stats never load them
    import torch

    from pagedq.worker.engine import sizing
    from pagedq.worker.models.loader import load_config, resolve_model

    path = resolve_model(config.model, packed=config.quantization == "auto")
    hf = load_config(path)
    device = (config.device or default_device()).split(":")[0]
    block = config.resolved_block_size()
    kv_dtype = sizing.kv_cache_dtype(config, device)
    elem = torch.empty((), dtype=kv_dtype).element_size()
    per_token = sizing.kv_bytes_per_token(hf, kv_dtype)
    heads = hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    layers, positions = hf.num_hidden_layers, config.max_model_len or hf.max_position_embeddings
    need_blocks = sizing.blocks_for([seq_len] * jobs, block)
    need = need_blocks * block * per_token
    lines = [
        f"model      {path.name}: {layers} layers, {kv_heads} KV heads x head dim {head_dim}, "
        f"{positions:,} positions",
        "weights    " + weights_text(path, config),
        f"KV cache   {str(kv_dtype).removeprefix('torch.')}: 2 x {layers} layers x {kv_heads} KV "
        f"heads x {head_dim} x {elem} B = {per_token:,} B ({per_token / 1024:.1f} KiB) per token; "
        f"blocks of {block} tokens",
        f"need       {jobs} jobs x {seq_len:,} tokens = {need_blocks:,} blocks = "
        f"{human(need)}: --num-kv-blocks {need_blocks} or --kv-cache-memory {gib(need)}",
    ]
    if seq_len > positions:
        lines.append(f"warning    {seq_len:,} tokens exceed the model's {positions:,} positions")
    if device == "cpu":
        budget = sizing.cpu_kv_budget(config)
        blocks = budget // (per_token * block)
        source = ("--kv-cache-memory" if config.kv_cache_memory else
                  f"min(2 GiB, a quarter of the {human(sizing.available_memory())} available "
                  "to this process)")
        lines.append(f"budget     {human(budget)} ({source}) = {blocks:,} blocks = "
                     f"{blocks * block:,} tokens: {blocks // sizing.cdiv(seq_len, block):,} "
                     f"jobs of {seq_len:,} tokens")
    else:
        lines.append(f"budget     on {device}: {config.gpu_memory_utilization} x the GPU's memory "
                     "- what is in use (weights) - the activation peak of one step (measured "
                     "at start); the engine logs the result")
    return "\n".join(lines)


# Bytes per projection weight of the formats quantized at load (int4: GGUF Q4_1 blocks, 20 B per
# 32 weights; int8: one byte plus a per-channel scale, negligible at real widths).
LOAD_QUANT_BYTES = {"int8": 1.0, "int4": 20 / 32}


def weights_text(path: Path, config: Any) -> str:
    """The resident weights: a packed GGUF's file size, else parameters x bytes per weight."""
    import torch  # seconds: as in plan_text

    from pagedq.worker.models.model_cache import packed_source  # torch: as in plan_text

    gguf = packed_source(path)
    if gguf is not None:
        return (f"{gguf.name} kept packed (quantization auto): about its size, "
                f"{gguf.stat().st_size / 1e9:.2f} GB")
    params = parameter_count(path)
    if not params:
        return "(size unknown: not safetensors)"
    per = LOAD_QUANT_BYTES.get(config.quantization)
    what = f"{config.quantization}, about"
    if per is None:
        per, what = torch.empty((), dtype=getattr(torch, config.dtype)).element_size(), config.dtype
    return f"{params / 1e6:,.1f} M parameters x {per:g} B ({what}) = {params * per / 1e9:.2f} GB"


def parameter_count(path: Path) -> int | None:
    """Parameters in the checkpoint's safetensors files, from their headers alone."""
    from pagedq.worker.models.loader import weight_files  # torch: as in plan_text

    total = 0
    for file in weight_files(path):
        if file.suffix != ".safetensors":
            return None
        with open(file, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, meta in header.items():
            if name != "__metadata__":
                count = 1
                for dim in meta["shape"]:
                    count *= dim
                total += count
    return total


def human(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / (1 << 20):.0f} MiB"


def gib(nbytes: int) -> str:
    """A --kv-cache-memory value that holds ``nbytes`` (rounded up)."""
    if nbytes >= GiB:
        return f"{-(-nbytes * 100 // GiB) / 100:g}GiB"
    return f"{-(-nbytes // (1 << 20))}MiB"
