"""The C++ CPU op library (``csrc/``): built once per machine, loaded once per process.

``pagedq_cpu_ops`` registers its ops as ``torch.ops.pagedq_cpu.*``, one source file each:

- ``paged_attention_rows`` (attention.cpp): attention read in place through the block table;
- ``skinny_linear`` (gemv.cpp): ``x @ w.T + b`` for 1-16 rows, one pass over the weights;
- ``rms_norm`` (rmsnorm.cpp): RMSNorm in one pass per row;
- ``argmax_rows`` (argmax.cpp): each row's first largest value's index (greedy sampling);
- ``decoder_layers`` (fused_layer.cpp): every decoder layer of a step in one call;
  ``decoder_layers_packed`` the same over packed projections;
- ``quant_gemv`` / ``quant_gemm`` (quant_gemv.cpp, quant_gemm.cpp): ``x @ W.T`` straight from
  packed weights (GGUF blocks, int8, bf16 rows): integer dot products for few rows (int16
  activations, panel_gemv.cpp from 8 rows on AVX2; or int8 ones on request: byte_gemv.cpp,
  byte_panel.cpp from 8 rows on AVX2, group_gemv.cpp), bf16 tiles
  for brgemm (AMX) or fp32 tiles for ATen's GEMM (any CPU) for many; ``QuantLinear``
  (quant_linear.cpp) picks between them per step.

library.cpp registers them; cpu_ops.h holds what the files share. The library compiles with
``torch.utils.cpp_extension`` (needs ``ninja`` and a C++ compiler) into the torch extensions
directory the first time a machine needs it, which takes a while once; later processes load the
cached build at once. It is built for AVX2 + FMA + F16C; the GEMV's AVX-512 tiles carry their own
target attribute, so one build serves both kinds of CPU and each call says which to run.

This module builds, loads and names the ops. Which of them run is the backend selector's choice
(:mod:`pagedq.kernels.backend`), which also checks the CPU before asking for a build.
"""

from __future__ import annotations

import hashlib
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import torch

from pagedq.kernel_switches import environment_switches
from pagedq.logging import get_logger
from pagedq.progress import waiting

LIBRARY = "pagedq_cpu_ops"
CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(CSRC / f for f in ("attention.cpp", "gemv.cpp", "rmsnorm.cpp", "argmax.cpp",
                                   "fused_layer.cpp",
                                   "quant_gemv.cpp", "quant_gemv_bw.cpp", "panel_gemv.cpp",
                                   "panel_gemv512.cpp", "panel_gemv_vnni.cpp", "quant_gemv_vnni.cpp",
                                   "group_gemv.cpp", "byte_gemv.cpp", "byte_panel.cpp",
                                   "quant_gemm.cpp", "quant_linear.cpp", "library.cpp"))
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
STALE_LOCK_SECONDS = 600  # a build lock this old was left by a process killed mid-compile
SKINNY_MAX_ROWS = 16  # kMaxSkinnyRows in csrc/cpu_ops.h: the most rows skinny_linear takes

_log = get_logger("pagedq.kernels.cpu")
_lock = threading.Lock()
_loaded: dict[str, CpuOps | None] = {}  # LIBRARY: the process's ops, or None once loading failed
_why_unavailable: list[str] = []


class Isa(IntEnum):
    """The ``isa`` argument of the ops with more than one vector path (csrc/cpu_ops.h: Isa)."""

    AVX2 = 0
    AVX512 = 1
    AVX512_VNNI = 2  # AVX-512 with BW and VNNI: the packed-weight kernels' integer dot products
    AVX2_VNNI = 3  # AVX2 with AVX-VNNI (no AVX-512): the AVX2 kernels, the panel on vpdpwssd


class GemmPrecision(IntEnum):
    """The ``precision`` argument of ``quant_gemm`` (csrc/cpu_ops.h: GemmPrecision)."""

    BF16X3 = 0  # bf16 heads and tails of both operands: the dequantized fp32 product
    BF16 = 1  # each operand rounded once to bf16: one AMX product per tile, no tails
    BF16X2 = 2  # weights rounded once, activations' heads and tails: two products per tile
    F32 = 3  # tiles dequantized to fp32, ATen's fp32 GEMM: any CPU (the bf16 ones need AMX)


class ActWidth(IntEnum):
    """The ``acts`` argument of ``quant_gemv`` (csrc/cpu_ops.h: kInt16Acts, kInt8Acts): the integer
    width its activations are rounded to, per 32 values."""

    INT16 = 16  # the default: the dequantized model's product to ~2^-15
    INT8 = 8  # llama.cpp's rounding (~2^-8), one byte product per weight: opt-in


# A QuantLinear ``precision`` with this bit set runs its GEMV on int8 activations (ActWidth.INT8);
# the low bits are the GEMM's GemmPrecision (csrc/cpu_ops.h: kInt8ActsBit).
INT8_ACTS_BIT = 1 << 8


@dataclass(frozen=True)
class CpuOps:
    """The library's ops, as loaded in this process."""

    paged_attention_rows: Callable
    skinny_linear: Callable
    rms_norm: Callable
    decoder_layers: Callable
    decoder_layers_packed: Callable
    quant_gemv: Callable
    quant_gemm: Callable
    quant_linear: Callable  # torch.classes.pagedq_cpu.QuantLinear
    argmax_rows: Callable
    build_dir: Path
    bf16_tiles: bool = False  # torch's bf16 brgemm runs here (AMX): the bf16 GEMM precisions


def build_directory(name: str, root: Path | None, sources: tuple[Path, ...] = ()) -> Path:
    """Per torch and Python version and per checkout, under ``root``, $TORCH_EXTENSIONS_DIR or
    torch's default.

    Keyed by the sources' folder too: two checkouts (a worktree beside the main one, an
    installed copy beside a source tree) would otherwise share one build directory and each
    load would recompile the other's sources.
    """
    # measured: cpp_extension adds ~0.6 s after torch; only a process loading the C++ ops pays
    from torch.utils.cpp_extension import get_default_build_root

    tag = f"torch{torch.__version__.split('+')[0]}_py{platform.python_version()}"
    if sources:
        where = str(Path(sources[0]).resolve().parent).encode()
        tag += "_" + hashlib.sha1(where).hexdigest()[:8]
    base = root or environment_switches().extensions_dir or get_default_build_root()
    return Path(base) / f"{name}_{tag}"


def clear_stale_lock(build_dir: Path) -> None:
    """cpp_extension waits forever on a lock file left by a process killed while compiling."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        _log.warning("cpu_ops_stale_lock_removed", path=str(lock), age_s=round(age))
        lock.unlink(missing_ok=True)


def build(sources: tuple[Path, ...], name: str, root: Path | None) -> CpuOps:
    """Compile (or load the cached build of) ``sources`` into one library; raises on failure."""
    from torch.utils.cpp_extension import load  # ~0.6 s, as above

    missing = [s for s in sources if not s.is_file()]
    if missing:
        raise FileNotFoundError(f"{missing[0]} is not installed")
    build_dir = build_directory(name, root, sources)
    build_dir.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(build_dir)
    start = time.perf_counter()
    # A cached build loads in well under the wait's delay, so only a real compile is announced.
    with waiting("compiling pagedq's C++ CPU kernels (once per machine and torch version, about "
                 f"2 minutes on 2 cores; kept in {build_dir})", _log):
        load(name=name, sources=[str(s) for s in sources], extra_cflags=CFLAGS,
             extra_ldflags=["-fopenmp"], build_directory=str(build_dir), is_python_module=False)
    _log.info("cpu_ops_ready", seconds=round(time.perf_counter() - start, 2), path=str(build_dir))
    ops = torch.ops.pagedq_cpu
    return CpuOps(ops.paged_attention_rows, ops.skinny_linear, ops.rms_norm, ops.decoder_layers,
                  ops.decoder_layers_packed, ops.quant_gemv, ops.quant_gemm,
                  torch.classes.pagedq_cpu.QuantLinear, ops.argmax_rows, build_dir,
                  bool(ops.bf16_tiles()))


def try_build(sources: tuple[Path, ...] = SOURCES, name: str = LIBRARY,
              root: Path | None = None) -> CpuOps | None:
    """:func:`build`, but a failure (no compiler, no ninja, a compile error, a missing source)
    logs one warning, is kept for :func:`unavailable_reason` and returns None."""
    try:
        return build(sources, name, root)
    except Exception as exc:  # any build failure: the caller keeps the PyTorch kernels
        why = str(exc) if isinstance(exc, FileNotFoundError) else (
            f"build failed: {type(exc).__name__}: {str(exc)[-2000:]}")
    _why_unavailable.append(why)
    _log.warning("cpu_ops_unavailable", reason=why, fallback="the PyTorch kernels",
                 hint="the C++ library needs ninja and g++; PAGEDQ_CPU_KERNEL=0 silences this")
    return None


def load_cpu_ops(root: Path | None = None) -> CpuOps | None:
    """The library's ops, built or loaded by the process's first call (into ``root``, else
    torch's extensions directory); None when that failed. Never raises. The caller checks the
    CPU first (:class:`pagedq.kernels.cpu_features.CpuFeatures`)."""
    if LIBRARY not in _loaded:
        with _lock:
            if LIBRARY not in _loaded:
                _loaded[LIBRARY] = try_build(root=root)
    return _loaded[LIBRARY]


def unavailable_reason() -> str | None:
    """Why the last build in this process failed (None when none did)."""
    return _why_unavailable[-1] if _why_unavailable else None
