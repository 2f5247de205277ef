"""CPU kernels for packed (quantized) weights: built on first use, like the attention kernel.

``csrc/quant_gemv.cpp`` computes ``x @ W.T`` for a few rows of ``x`` straight from GGUF blocks or
per-channel int8 (AVX-512 VNNI where the CPU has it, AVX2 otherwise); ``csrc/quant_gemm.cpp``
computes many rows by dequantizing tiles of W to bf16 for oneDNN's AMX/AVX-512 micro-kernel;
``csrc/quant_linear.cpp`` wraps both as ``torch.classes.pagedq_quant.Linear``, a layer that picks
one per step by its row count.
:func:`quant_ops` returns None (with one warning) where the library cannot be built, and callers
then dequantize in PyTorch.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from pagedq.kernels.cpu_attention import (
    CFLAGS,
    _build_directory,
    _clear_stale_lock,
    _cpu_supports_kernel,
)
from pagedq.worker.logging import get_logger

_CSRC = Path(__file__).parent / "csrc"
SOURCES = (_CSRC / "quant_gemv.cpp", _CSRC / "quant_gemm.cpp", _CSRC / "quant_linear.cpp")
NAME = "pagedq_quant"
_log = get_logger("pagedq.kernels.quant")
_lock = threading.Lock()
_state: dict[str, SimpleNamespace | None] = {}


def _build() -> SimpleNamespace:
    from torch.utils.cpp_extension import load

    build_dir = _build_directory(NAME)
    build_dir.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(build_dir)
    start = time.perf_counter()
    load(name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS,
         extra_ldflags=["-fopenmp"], build_directory=str(build_dir), is_python_module=False)
    _log.info("quant_kernel_ready", seconds=round(time.perf_counter() - start, 2), path=str(build_dir))
    return torch.ops.pagedq_quant


def _load() -> SimpleNamespace | None:
    supported, why = _cpu_supports_kernel()
    if supported:
        try:
            return _build()
        except Exception as exc:  # no compiler, no ninja, a build error: dequantize in torch instead
            why = f"build failed: {type(exc).__name__}: {str(exc)[-2000:]}"
    _log.warning("quant_kernel_unavailable", reason=why, fallback="dequantize in PyTorch")
    return None


def quant_ops():
    """``torch.ops.pagedq_quant`` once the library is loaded; None where it cannot be built."""
    if "ops" not in _state:
        with _lock:
            if "ops" not in _state:
                _state["ops"] = _load()
    return _state["ops"]
