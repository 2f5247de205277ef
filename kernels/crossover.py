"""Where the packed GEMV hands a step over to the GEMM, measured on this machine.

Why: backend.py's F32_GEMV_ROWS were measured on two machines, and the crossover moves a long
way from one CPU to the next. On an AMD EPYC (Zen 5, 2 threads) the grouped Q6_K GEMV beats
fp32 tiles 2.6x from 64 to 512 rows where the table (measured on an Intel Xeon) hands over at 65,
and the AVX2 panel beats them 1.5x up to 1024 rows where the table stops at 256: every prefill
chunk of a Q4_K_M model (whose Q6_K tensors are a third of its bytes) paid for it. So where the
GEMM multiplies fp32 tiles (every CPU without AMX), the engine times both kernels for each packed
format its model holds, once, on one matrix at a ladder of row counts, and hands over where the
GEMM starts to win (interpolated between the two rungs around it).

That costs ~0.5-2 s a format on 2 cores, once per machine: the result is kept in pagedq's cache
(``crossovers.json``) under the kernels' sources, the CPU's identity, the ISA level, the thread
count and the activations' width, and later engines read it. Each figure is the fastest of a few
calls, as quant_bench times them: other processes only ever add time, so a loaded machine
still measures what the kernels cost. ``EngineConfig.kernel_crossovers="table"`` keeps the
table (and AMX machines always do: the bf16 tiles cross within 16 rows, finer than a ladder).
Delete the cache file to measure again (after a BIOS or VM change, say).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from pagedq.file_lock import file_lock
from pagedq.kernels.backend import ALL_ROWS, KernelPlan, PackedChoice
from pagedq.kernels.block_formats import (
    FORMATS,
    QuantWeight,
    as_bf16,
    cpu_kernel_inputs,
    quantize_int8,
)
from pagedq.kernels.cpu_features import cpu_identity
from pagedq.kernels.cpu_ops import CSRC, Isa
from pagedq.logging import get_logger
from pagedq.redis_url import pagedq_cache_dir

# Row counts timed, lowest first. Not 2048 (a prefill chunk's most): each buffer of a rung
# grows with its rows (the activations, their int16 or int8 codes, the GEMM's packing, the
# output), and a rung of 2048 raised the process's peak by ~75 MB, which the first `pagedq
# chat` on an empty cache (the measurement runs in it) paid against its 500 MB promise: 472-505
# MB measured (AMD EPYC Zen 5), against 425-428 without the measurement. From a few hundred
# rows on both kernels are compute-bound and their times grow alike with the rows, so a GEMV
# ahead at 1024 keeps its lead at 2048 (the panel against fp32 tiles, capped at avx2: 1.5x at
# 256, 512 and 1024 rows).
LADDER = (16, 32, 64, 128, 256, 512, 1024)
# (N, K) of the matrix timed: K a multiple of 256 (the K-quants' super-block), the bundled
# model's down projection's width; N big enough that the weights leave L1/L2 as a real
# model's do (1.6 MB in Q8_0), small enough that a rung at 1024 rows takes ~25 ms
SHAPE = (1024, 1536)
REPEATS = 3  # timed calls per kernel and rung, after a warm-up call; the fastest counts
CACHE_FILE = "crossovers.json"
VERSION = 3  # bump when the measurement itself changes (ladder, shape); kernel sources key themselves

_log = get_logger("pagedq.kernels.crossover")


def random_blocks(fmt: str, n: int, k: int, gen: torch.Generator) -> QuantWeight:
    """An ``n`` x ``k`` weight of random codes in ``fmt`` with small positive fp16 scales
    (a kernel's speed does not depend on the values; random scales would hold NaNs)."""
    if fmt == "int8":
        return quantize_int8(torch.randn(n, k, generator=gen))
    if fmt == "bf16":  # random bits would include NaNs and subnormals
        return as_bf16(torch.randn(n, k, generator=gen))
    f = FORMATS[fmt]
    raw = torch.randint(0, 256, (n * k // f.block, f.nbytes), dtype=torch.uint8, generator=gen)
    scale_at = (208,) if fmt == "q6_k" else (0, 2) if fmt in ("q4_1", "q5_1", "q4_k", "q5_k") else (0,)
    for off in scale_at:
        raw[:, off:off + 2] = torch.full((raw.shape[0], 1), 0.01).half().view(torch.uint8)
    return QuantWeight(f, raw.reshape(n, -1), (n, k))


def measures(choice: PackedChoice) -> bool:
    """Whether ``choice``'s crossover is measured: the C++ pair with fp32 tiles for the GEMM
    (bf16 tiles cross within 16 rows, and float32 segments have no packed GEMV)."""
    return choice.kind == "cpp" and choice.precision == "fp32" and choice.weight_format != "float32"


def measure_gemv_rows(choice: PackedChoice, seed: int = 0) -> int:
    """The row count up to which ``choice``'s GEMV beats its GEMM here: ALL_ROWS if it wins at
    every rung, the table's value if it loses at the first."""
    gen = torch.Generator().manual_seed(seed)
    weight = random_blocks(choice.weight_format, *SHAPE, gen)
    gemv, gemm = (_linear(weight, replace(choice, gemv_rows=rows)) for rows in (ALL_ROWS, 0))
    last_win: tuple[int, float] | None = None
    for rows in LADDER:
        x = torch.randn(rows, SHAPE[1], generator=gen)
        gap = _fastest(gemv, x) - _fastest(gemm, x)  # seconds the GEMV is behind
        if gap > 0:
            return choice.gemv_rows if last_win is None else _between(last_win, (rows, gap))
        last_win = (rows, gap)
    return ALL_ROWS


def _linear(weight: QuantWeight, choice: PackedChoice):
    """The C++ QuantLinear the engine would build for ``weight`` on ``choice``."""
    data, codes, scales = cpu_kernel_inputs([weight], [choice.isa == int(Isa.AVX512_VNNI)])
    return choice.ops.quant_linear(data, codes, scales, None, weight.shape[1],
                                   [choice.gemv_rows], choice.isa, choice.precision_code)


def _fastest(linear, x: torch.Tensor) -> float:
    linear.forward(x)  # a first call at a new shape allocates (oneDNN, ATen's buffers)
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        linear.forward(x)
        best = min(best, time.perf_counter() - start)
    return best


def _between(win: tuple[int, float], loss: tuple[int, float]) -> int:
    """Where the GEMV's lead crosses zero between a rung it won and the next, which it lost
    (linear in rows: both kernels' times grow about linearly there), to a multiple of 16."""
    (low, lead), (high, lag) = win, loss
    rows = low + (high - low) * (-lead) / (lag - lead)
    return max(low, int(rows) // 16 * 16)


# --------------------------------------------------------------------------- the kept figures


@functools.cache
def kernels_id(csrc: Path = CSRC) -> str:
    """The C++ kernels' sources as 8 hex digits. Why: a figure timed on kernels that have since
    changed (a faster panel, a new pass size) is stale; keyed by their content, an upgraded
    install measures again at its first start instead of a release remembering to bump VERSION."""
    digest = hashlib.sha1()
    for path in sorted(p for p in csrc.iterdir() if p.suffix in (".cpp", ".h", ".inc")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:8]


def _version() -> str:
    return f"v{VERSION}-{kernels_id()}"


def cache_key(choice: PackedChoice, level: str | None) -> str:
    """What a kept figure is valid for: these kernels, this CPU, the level pagedq's kernels ran
    at and the one torch's own kernels run at (a capped process hides wider ones from them too:
    cpu_features.isa_environment), the threads, the GEMV's activations and the format."""
    acts = "int8" if choice.int8_acts else "int16"
    gemm = torch.backends.cpu.get_cpu_capability()
    return (f"{_version()}|{cpu_identity()}|{level}|{gemm}|{torch.get_num_threads()} threads|"
            f"{acts}|{choice.weight_format}")


def cache_path() -> Path:
    return pagedq_cache_dir() / CACHE_FILE


def kept_for_this_cpu() -> dict[str, int]:
    """The kept figures of this CPU, keyed by what follows its identity in cache_key (level,
    torch's level, threads, activations, format): the bench records them beside the hardware,
    since every many-row figure it reports ran on them."""
    prefix = f"{_version()}|{cpu_identity()}|"
    return {k[len(prefix):]: v for k, v in _read(cache_path()).items() if k.startswith(prefix)}


def _read(path: Path) -> dict[str, int]:
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or a torn write from an old version
        return {}
    return {k: v for k, v in kept.items() if isinstance(v, int)} if isinstance(kept, dict) else {}


def _write(path: Path, figures: dict[str, int]) -> None:
    """Add ``figures`` to the file: under a lock (two engines starting together each add
    their own, neither loses the other's) and replaced whole (a reader never sees half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path.with_name(path.name + ".lock")):
        kept = {**_read(path), **figures}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".crossovers-")
        with os.fdopen(fd, "w") as f:
            json.dump(kept, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


@functools.cache
def _kept_or_measured(key: str, choice: PackedChoice) -> tuple[int, bool]:
    """(rows, whether measured now) for ``key``: from the cache file, else measured and kept.
    Cached per process too, so a process measures a format once whatever engines it starts."""
    path = cache_path()
    kept = _read(path)
    if key in kept:
        return kept[key], False
    rows = measure_gemv_rows(choice)
    try:
        _write(path, {key: rows})
    except OSError as exc:  # a read-only home: measured again next start, said once here
        _log.warning("crossover_not_kept", path=str(path), error=str(exc))
    return rows, True


def measured_plan(plan: KernelPlan, formats: set[str]) -> KernelPlan:
    """``plan`` with the GEMV/GEMM crossover of each of ``formats`` (the packed formats a model
    holds) measured on this machine where :func:`measures` says so; logs what changed."""
    level = plan.backend.cpu.level if plan.backend.cpu else None
    routes = dict(plan.packed)
    found: dict[str, int] = {}
    start = time.perf_counter()
    fresh = False
    for fmt in sorted(formats):
        choice = routes.get(fmt)
        if choice is None or not measures(choice):
            continue
        rows, now = _kept_or_measured(cache_key(choice, level), choice)
        fresh |= now
        routes[fmt] = replace(choice, gemv_rows=rows)
        found[fmt] = rows
    if found:
        _log.info("kernel_crossovers", measured=fresh, seconds=round(time.perf_counter() - start, 2),
                  gemv_rows_up_to={f: ("all" if r == ALL_ROWS else r) for f, r in found.items()},
                  table={f: ("all" if plan.packed[f].gemv_rows == ALL_ROWS else plan.packed[f].gemv_rows)
                         for f in found}, cache=str(cache_path()))
    backend = replace(plan.backend, packed=tuple(routes.get(c.weight_format, c)
                                                 for c in plan.backend.packed))
    return replace(plan, backend=backend, packed=routes)
