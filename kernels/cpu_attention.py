"""CPU paged attention straight from the block table: a C++/AVX2 kernel built on first use.

Why: the pure-torch CPU path gathers each sequence's K/V blocks into a padded copy and runs SDPA
over it, so a decode step reads the cache, writes a copy and reads the copy again. Decode is
memory-bound; ``csrc/paged_attention_cpu.cpp`` walks the block table in place and reads each
K/V row once (about 3x faster for 32-128 decodes on the 2-core dev box). Short prefill chunks
(``q_len <= MAX_KERNEL_CHUNK`` over at most ``MAX_KERNEL_CHUNK_KEYS`` query-key pairs, see
:func:`kernel_takes`) go through it as well; longer ones keep SDPA, whose matrix multiplies win
once many query rows share each K/V row.

The kernel compiles with ``torch.utils.cpp_extension`` (needs ``ninja`` and a C++ compiler) into
the torch extensions directory (``TORCH_EXTENSIONS_DIR`` when set) the first time a process needs
it (~25 s once; later processes load the cached library instantly). It is used only on x86-64
CPUs with AVX2/FMA/F16C. When it is switched off (``PAGEDQ_CPU_KERNEL=0``), unsupported or fails
to build, :func:`cpu_kernel` returns None (with one warning) and the caller keeps the torch path.
"""

from __future__ import annotations

import math
import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedq.kernels.plan import AttentionPlan, mixed_ok
from pagedq.worker.logging import get_logger

ENV_SWITCH = "PAGEDQ_CPU_KERNEL"
MAX_KERNEL_CHUNK = 32  # prefill chunks up to this many tokens beat gather + SDPA in the kernel
# ... while their query rows x visible keys stay under this: the kernel reads every K/V row once
# per query row, SDPA once per chunk. Measured (SmolLM2, 8 decodes + a 32-token chunk of a
# 1k-token prompt, 2 threads): the kernel's step grew from 93 to 175-220 ms as the prompt's
# context grew to 1k, SDPA's from 105 to 130-136 ms; they cross near 32 x 430 keys.
MAX_KERNEL_CHUNK_KEYS = 16384
MIN_WORK_PER_THREAD = 8192  # (key, KV head) pairs, ~0.2 ms: less than that is not worth a thread
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
STALE_LOCK_SECONDS = 600  # a build lock this old was left by a process killed mid-compile

_CSRC = Path(__file__).parent / "csrc"
# the attention kernel, skinny GEMV and RMSNorm; the fused decoder layer (cpu_ops.h is shared)
_SOURCES = (_CSRC / "paged_attention_cpu.cpp", _CSRC / "decoder_layer_cpu.cpp")
_NAME = "pagedq_cpu_attention"
_log = get_logger("pagedq.kernels.cpu")
_lock = threading.Lock()
_state: dict[str, Callable | None] = {}  # "op": the loaded op, or None once loading failed
_why_unavailable: list[str] = []


@dataclass
class KernelRows:
    """Query rows the C++ kernel computes in one call, built once per step.

    ``rows[i] = (query row, sequence, visible keys)``. Work items are (row, range of
    ``heads_per_item`` KV heads); ``grain`` is the fewest items a thread gets, so small steps
    stay on one thread.
    """

    rows: torch.Tensor  # int64 [num_rows, 3], contiguous
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks], contiguous rows
    heads_per_item: int
    grain: int


def kernel_switched_on() -> bool:
    """False when ``PAGEDQ_CPU_KERNEL=0``: read per call so tests and benches can flip it."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _cpu_supports_kernel() -> tuple[bool, str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False, f"CPU architecture {platform.machine()} is not x86-64"
    try:
        flags = next(
            set(line.split(":", 1)[1].split())
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        capability = torch.backends.cpu.get_cpu_capability()
        return capability in ("AVX2", "AVX512"), f"torch reports CPU capability {capability}"
    missing = {"avx2", "fma", "f16c"} - flags
    return not missing, f"CPU lacks {', '.join(sorted(missing))}"


def _build_directory(name: str) -> Path:
    """Per torch/Python version, under TORCH_EXTENSIONS_DIR or torch's default extensions root."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    tag = f"torch{torch.__version__.split('+')[0]}_py{platform.python_version()}"
    return Path(root) / f"{name}_{tag}"


def _clear_stale_lock(build_dir: Path) -> None:
    """cpp_extension waits forever on a lock file left by a process killed while compiling."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        _log.warning("cpu_kernel_stale_lock_removed", path=str(lock), age_s=round(age))
        lock.unlink(missing_ok=True)


def _build(sources: tuple[Path, ...] = _SOURCES, name: str = _NAME) -> Callable:
    """Compile (or load the cached) ``sources`` into one library and return its attention op."""
    from torch.utils.cpp_extension import load

    build_dir = _build_directory(name)
    build_dir.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(build_dir)
    start = time.perf_counter()
    load(
        name=name,
        sources=[str(s) for s in sources],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        is_python_module=False,
    )
    _log.info("cpu_kernel_ready", seconds=round(time.perf_counter() - start, 2), path=str(build_dir))
    return torch.ops.pagedq_cpu.paged_attention_rows


def cpu_kernel() -> Callable | None:
    """The compiled ``paged_attention_rows`` op, built on first call; None when unavailable.

    Never raises: a CPU without AVX2, a missing compiler/ninja or a build error logs one warning
    (per process) and returns None, and the caller uses the pure-torch path.
    """
    if not kernel_switched_on():
        return None
    if "op" in _state:
        return _state["op"]
    with _lock:
        if "op" not in _state:
            _state["op"] = _load_once()
    return _state["op"]


def skinny_linear_op() -> Callable | None:
    """``torch.ops.pagedq_cpu.skinny_linear`` (1-16 row fp32 GEMV, one pass over the weights), built
    with the attention kernel; None when the kernel library is unavailable."""
    return torch.ops.pagedq_cpu.skinny_linear if cpu_kernel() is not None else None


def unavailable_reason() -> str | None:
    """Why :func:`cpu_kernel` returned None in this process (None if it loaded or was not tried)."""
    if not kernel_switched_on():
        return f"switched off by {ENV_SWITCH}=0"
    return _why_unavailable[-1] if _why_unavailable else None


def _load_once(*sources: Path, name: str = _NAME) -> Callable | None:
    sources = sources or _SOURCES
    supported, why = _cpu_supports_kernel()
    missing = [s for s in sources if not s.is_file()]
    if supported and missing:
        why = f"{missing[0]} is not installed"
    elif supported:
        try:
            return _build(sources, name)
        except Exception as exc:  # any build failure (no compiler, no ninja, ...): use the torch path
            why = f"build failed: {type(exc).__name__}: {str(exc)[-2000:]}"
    _why_unavailable.append(why)
    _log.warning(
        "cpu_kernel_unavailable",
        reason=why,
        fallback="torch gather + SDPA",
        hint="the C++ kernel needs an x86-64 CPU with AVX2, ninja and g++; PAGEDQ_CPU_KERNEL=0 "
        "silences this",
    )
    return None


def kernel_takes(q_len: int, seq_len: int) -> bool:
    """Whether a sequence's ``q_len`` query rows (seeing up to ``seq_len`` keys) are cheaper in
    the kernel than in gather + SDPA: every decode, and short chunks over short contexts."""
    return q_len == 1 or (0 < q_len <= MAX_KERNEL_CHUNK and q_len * seq_len <= MAX_KERNEL_CHUNK_KEYS)


def kernel_fits(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these tensors (CPU, fp32/fp16/bf16, an fp16/bf16 cache under
    fp32 queries, head_dim % 8, unit strides)."""
    return (
        query.device.type == "cpu"
        and query.dtype in KERNEL_DTYPES
        and k_cache.dtype == v_cache.dtype
        and mixed_ok(query.dtype, k_cache.dtype)
        and query.shape[-1] % 8 == 0
        and query.stride(-1) == 1
        and k_cache.stride(-1) == 1
        and v_cache.stride(-1) == 1
    )


def kernel_rows(plan: AttentionPlan, ids: list[int], num_kv_heads: int) -> KernelRows:
    """Kernel rows of the sequences ``ids`` (all their query tokens), built with tensor ops.

    Token ``j`` of a ``q_len``-token chunk sits at position ``seq_len - q_len + j`` and so sees
    ``seq_len - q_len + j + 1`` keys; a decode token sees all ``seq_len``.
    """
    idx = torch.tensor(ids, dtype=torch.long)
    q_lens = torch.tensor([plan.q_lens[i] for i in ids], dtype=torch.long)
    seq_lens = torch.tensor([plan.seq_lens_host[i] for i in ids], dtype=torch.long)
    starts = plan.cu_seqlens_q.cpu().long()[idx]
    total = int(q_lens.sum())
    first_row = (q_lens.cumsum(0) - q_lens).repeat_interleave(q_lens, output_size=total)
    offset = torch.arange(total) - first_row
    rows = torch.stack(
        [
            starts.repeat_interleave(q_lens, output_size=total) + offset,
            idx.repeat_interleave(q_lens, output_size=total),
            (seq_lens - q_lens).repeat_interleave(q_lens, output_size=total) + offset + 1,
        ],
        dim=1,
    ).contiguous()
    threads = torch.get_num_threads()
    # Whole rows (all KV heads) read contiguous cache memory; split heads only to feed threads.
    heads_per_item = num_kv_heads if total >= 2 * threads else 1
    items = total * -(-num_kv_heads // heads_per_item)
    work = max(int(rows[:, 2].sum()), 1) * num_kv_heads
    grain = max(1, math.ceil(items * MIN_WORK_PER_THREAD / work))
    return KernelRows(
        rows=rows,
        block_table=plan.block_table.cpu().contiguous(),
        heads_per_item=heads_per_item,
        grain=grain,
    )


def run_kernel(
    op: Callable,
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: KernelRows,
    scale: float,
) -> None:
    """Write the attention of ``rows`` into ``out`` (other rows untouched)."""
    op(out, query, k_cache, v_cache, rows.block_table, rows.rows, scale, rows.heads_per_item, rows.grain)
