"""The kernel switches: what the environment says about which kernels may run, read once.

This module is on the ground floor (no torch, nothing above it) so that both sides can read it:
``pagedq.kernels.backend`` hands :class:`Switches` to its selector, and
``pagedq.worker.config.EngineConfig`` takes its defaults from :func:`environment_switches`, which
makes every switch a flag too (``--no-cpu-kernels`` beside ``PAGEDQ_CPU_KERNEL=0``). The default
packed-GEMM precision is written here, once, for the same reason.

    PAGEDQ_CPU_KERNEL=0    no C++ kernels: attention "sdpa", linears oneDNN or torch
    PAGEDQ_ONEDNN=0        no oneDNN-prepacked weights: batched CPU linears use F.linear
    PAGEDQ_FUSED_LAYER=0   the per-op Python decoder layer instead of the fused C++ one
    PAGEDQ_CPU_ISA=LEVEL   the process sees its CPU capped at LEVEL (avx2, avx2_vnni, avx512,
                           avx512_vnni, amx), in Python and in the C++ ops; EngineConfig.cpu_isa
                           caps further
    TRITON_INTERPRET=1     allow attention "triton" on CPU tensors (Triton's interpreter)
    TORCH_EXTENSIONS_DIR   where the C++ library is built and cached

The last two are Triton's and torch's own variables, which those libraries read themselves, so
they stay environment-only; so does ``PAGEDQ_CPU_BF16_CONVERT=0`` (the C++ library's test
switch that makes an AVX512_BF16 CPU run the other bf16 decoders: same results, read by C++).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

PackedGemmPrecision = Literal["bf16", "bf16x2", "bf16x3", "fp32"]
PACKED_GEMM_PRECISIONS: tuple[str, ...] = get_args(PackedGemmPrecision)
# Weights rounded once to bf16, activations' heads and tails: two AMX products per tile, the
# activations keep fp32 accuracy (see EngineConfig.packed_gemm_precision).
DEFAULT_PACKED_PRECISION: PackedGemmPrecision = "bf16x2"
# The packed GEMV's activation width: int16 (the default: the dequantized model to ~2^-15) or
# int8 (llama.cpp's rounding: one byte product per weight, faster where the GEMV is
# compute-bound, but greedy output parts from the dequantized model sooner).
PackedActivations = Literal["int16", "int8"]
PACKED_ACTIVATIONS: tuple[str, ...] = get_args(PackedActivations)
OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Switches:
    """The environment's say in the kernel choice; the defaults are what an unset environment
    means. An engine's own switches are its EngineConfig fields, which default to these."""

    cpu_kernels: bool = True  # PAGEDQ_CPU_KERNEL
    onednn: bool = True  # PAGEDQ_ONEDNN
    fused_layer: bool = True  # PAGEDQ_FUSED_LAYER
    triton_interpret: bool = False  # TRITON_INTERPRET
    extensions_dir: Path | None = None  # TORCH_EXTENSIONS_DIR
    cpu_isa: str = "auto"  # PAGEDQ_CPU_ISA

    @classmethod
    def from_environ(cls, env: Mapping[str, str] = os.environ) -> Switches:
        def on(name: str, default: bool) -> bool:
            value = env.get(name, "").strip().lower()
            return default if value == "" else value not in OFF

        ext = env.get("TORCH_EXTENSIONS_DIR")
        return cls(cpu_kernels=on("PAGEDQ_CPU_KERNEL", True), onednn=on("PAGEDQ_ONEDNN", True),
                   fused_layer=on("PAGEDQ_FUSED_LAYER", True),
                   triton_interpret=on("TRITON_INTERPRET", False),
                   extensions_dir=Path(ext).expanduser() if ext else None,
                   cpu_isa=env.get("PAGEDQ_CPU_ISA", "").strip().lower() or "auto")


@functools.cache
def environment_switches() -> Switches:
    """This process's switches, read from the environment on first use and then kept: a later
    change of the environment does not change what runs."""
    return Switches.from_environ()
