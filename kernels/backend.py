"""The backend selector: which kernels run the model, decided once at engine start.

Each kind of work a step does has a few implementations, and the :class:`Backend` names the one
that runs:

- ``attention``: ``"cpp"`` (the C++ kernel reads K/V in place through the block table; it takes
  decodes and short prefill chunks, and SDPA takes longer chunks, see
  :func:`pagedq.kernels.cpu_attention.kernel_takes`), ``"sdpa"`` (the K/V blocks gathered into a
  padded copy, then torch's fused ``scaled_dot_product_attention``) or ``"triton"`` (one Triton
  launch per step: CUDA, or CPU tensors in Triton's interpreter);
- ``kv_write``: ``"torch"`` (indexed copy) or ``"triton"``;
- ``linears``: one :class:`LinearChoice` per weight format, which picks by the step's row count
  (the C++ skinny GEMV for few rows, oneDNN-prepacked weights or ``F.linear`` for more);
- ``packed``: one :class:`PackedChoice` per packed weight format (GGUF blocks, int8/int4, bf16
  rows): the C++ packed GEMV for few rows and the bf16-tile GEMM for more (``"cpp"``), the
  Triton weight-only GEMM (``"triton"``, CUDA), or dequantize-then-``F.linear`` (``"torch"``).
  The GEMM runs in the precision the engine asks for (``packed_gemm_precision``): ``"bf16"``
  (one AMX product per tile), ``"bf16x2"`` (the default: weights rounded once, activations'
  heads and tails, two products), ``"bf16x3"`` (heads and tails of both: the dequantized fp32
  product) or ``"fp32"`` (fp32 tiles into ATen's GEMM: what every CPU without AMX runs, whatever
  was asked);
- ``norm``: ``"cpp"`` or ``"torch"``; ``layer``: ``"cpp-fused"`` (every decoder layer of a step
  in one C++ call, for steps whose rows all fit the attention kernel) or ``"python"``.

The :class:`Selector` decides from the device, the model's dtype, the KV-cache dtype and head
size, the CPU's vector extensions (:mod:`pagedq.kernels.cpu_features`; capped at a level by
``cpu_isa``, so every level a machine runs can be run and tested there) and the
:class:`~pagedq.kernel_switches.Switches` it is given (``cpu_kernels``, ``onednn``,
``fused_layer``: EngineConfig fields, so flags, whose defaults :mod:`pagedq.kernel_switches`
reads from ``PAGEDQ_CPU_KERNEL``, ``PAGEDQ_ONEDNN`` and ``PAGEDQ_FUSED_LAYER`` once per
process; ``PAGEDQ_CPU_ISA`` caps the whole process, ``TRITON_INTERPRET`` and
``TORCH_EXTENSIONS_DIR`` are Triton's and torch's own)
and logs one line saying what it chose and why. Model code is built from the Backend's
:class:`KernelPlan` (:meth:`Backend.plan`: the float weights' linear and each packed format's
route, resolved once); it reads neither the environment nor module globals. Tests and
benchmarks build a Selector with explicit switches or CPU features instead of changing the
environment.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedq.kernel_switches import (
    DEFAULT_PACKED_PRECISION,
    PACKED_ACTIVATIONS,
    PACKED_GEMM_PRECISIONS,
    Switches,
    environment_switches,
)
from pagedq.kernels.cpu_attention import unsupported
from pagedq.kernels.cpu_features import CpuFeatures, detect_cpu_features
from pagedq.kernels.cpu_ops import (
    INT8_ACTS_BIT,
    SKINNY_MAX_ROWS,
    CpuOps,
    GemmPrecision,
    Isa,
    load_cpu_ops,
    unavailable_reason,
)
from pagedq.logging import get_logger

ATTENTION = ("cpp", "sdpa", "triton")
KV_WRITE = ("torch", "triton")
ONEDNN_BATCH_HINT = 64  # the row count oneDNN lays out the prepacked weights for

_log = get_logger("pagedq.kernels.backend")


class BackendUnavailableError(RuntimeError):
    """The requested kernel backend cannot run here; the message says what to use instead."""


@functools.cache
def triton_available() -> bool:
    """True when triton imports (it is an optional, x86-64-only dependency)."""
    try:
        import triton  # noqa: F401 - optional dependency
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class LinearChoice:
    """How ``x @ W.T + b`` runs for one weight format, by the step's row count.

    Steps of at most ``skinny_rows`` rows take the C++ skinny GEMV (``skinny`` names its ISA);
    more rows take ``batched``: oneDNN on a prepacked copy of W, or ``F.linear``. The quantized
    formats add their own choices here, each with the kernels that read that format.
    """

    weight_format: str  # "float32", "bfloat16", ...
    batched: str  # "onednn" | "torch"
    skinny: str | None = None  # "cpp-skinny-avx512" | "cpp-skinny-avx2" | None
    skinny_rows: int = 0
    ops: CpuOps | None = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        return f"{self.skinny}<={self.skinny_rows}+{self.batched}" if self.skinny else self.batched

    @property
    def isa(self) -> int:
        """The GEMV's ``isa`` argument (the fused layer passes it on)."""
        return int(Isa.AVX512 if self.skinny == "cpp-skinny-avx512" else Isa.AVX2)

    def kernel(self, rows: int) -> str:
        """What runs for a step of ``rows`` rows."""
        return self.skinny if self.skinny and rows <= self.skinny_rows else self.batched

    def prepack(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The copy of ``weight`` that ``batched`` reads (oneDNN's blocked layout), else None."""
        if self.batched != "onednn":
            return None
        return torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_BATCH_HINT)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 packed: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias`` by the route for x's row count; ``packed``: the
        :meth:`prepack` copy of ``weight``, if any."""
        if 0 < x.shape[0] <= self.skinny_rows:
            out = x.new_empty((x.shape[0], weight.shape[0]))
            self.ops.skinny_linear(out, x.contiguous(), weight, bias, self.isa)
            return out
        if packed is not None:
            rows = x.shape[0]
            padded = padded_rows(rows)
            if padded != rows:
                x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
            out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
            return out[:rows]
        return F.linear(x, weight, bias)


def padded_rows(rows: int) -> int:
    """The rows a oneDNN GEMM runs on: ``rows`` rounded up to a bucket (multiples of 16 up to
    128, then eight buckets per doubling: at most 1/8 extra rows).

    Every step's token count would otherwise be a new GEMM shape, and the memory oneDNN and
    glibc keep per shape made a worker's RSS grow by gigabytes over a day of varied prompts;
    a few dozen shapes keep it flat. csrc/fused_layer.cpp's ``padded_rows`` is the same.
    """
    step = max(16, (1 << (rows.bit_length() - 1)) // 8)
    return -(-rows // step) * step


# Rows up to which each packed format's GEMV beats its bf16-tile GEMM in the default precision
# (bf16x2) on CPUs with AMX (the only ones where torch runs bf16 tiles); measured with ``python -m
# pagedq.bench.quant_kernels`` over SmolLM2-135M's matrices (docs/quantization.md has the
# table): the GEMM costs about the same from 1 to 16 rows (dequantizing dominates), the GEMV
# grows with every row. bf16x3's third product and weight tails keep the GEMV to
# BF16X3_GEMV_ROWS.
GEMV_ROWS = {"q4_0": 10, "q4_1": 10, "q5_0": 10, "q5_1": 10, "q8_0": 10, "q4_k": 8, "q5_k": 8,
             "q6_k": 10, "int8": 10, "bf16": 8, "float32": SKINNY_MAX_ROWS}
BF16X3_GEMV_ROWS = 16
# Activation rows from which the AVX2 GEMV runs its panel (csrc/int16_acts.h: kPanelRows;
# csrc/panel_gemv.cpp), on int16 activations; where int8 ones were asked for, the byte panel
# (csrc/byte_panel.cpp) for BYTE_PANEL_FORMATS, the int16 one for the rest.
PANEL_ROWS = 8
PANEL_ROWS_Q6K = 5  # Q6_K alone (kPanelRowsQ6K): its row-at-a-time kernel is the slowest
WIDE_PANEL_ROWS = 12  # from here AVX-512BW CPUs without VNNI run it 16 rows a vector (kWidePanelRows)


def panel_from(weight_format: str, isa: int = Isa.AVX2) -> int:
    """The row count from which the AVX2 GEMV runs its panel for ``weight_format``: Q6_K from
    5 rows, but at the avx512 level (``Isa.AVX512``), where its 1-7 rows run in 512-bit
    vectors (csrc/quant_gemv_bw.cpp), from 8 like the rest."""
    return PANEL_ROWS_Q6K if weight_format == "q6_k" and isa != Isa.AVX512 else PANEL_ROWS


# Without AMX the GEMM multiplies fp32 tiles (precision "fp32": ATen's sgemm). Rows up to which
# each GEMV beats it, per GEMV kind and format: the starting point, which an engine replaces with
# its own machine's figures for the formats its model holds (kernels/crossover.py, measured
# once per machine: these moved 4-30x from the Intel Xeon to a Zen 5). Measured with
# quant_bench (``f32gemm-<fmt>`` against ``gemv-``/``rowgemv-<fmt>``, 16-256 rows) on an AMD EPYC
# (Zen 4: AVX-512 VNNI/BF16, no AMX), 2 threads, at its own level and capped at avx2
# (docs/quantization.md has the table).
# "grouped": the VNNI GEMV over rows grouped 16 at a time beat the fp32 GEMM at every row count
# measured (Q4_1 at 256 rows: 166 against 433 ms a pass: vpdpbusd does 4x the products of an fp32
# FMA), so it takes every step; "vnni": the row-at-a-time VNNI GEMV; "avx2": the int16-code GEMV
# of AVX2 and AVX-512-without-VNNI CPUs. Grouped Q6_K and Q5_K were measured on an Intel Xeon
# (Emerald Rapids, no AMX; 1 thread, loaded, --shapes down) whose fp32 tiles are faster: Q6_K
# ahead at 48 rows (27.2 against 30.1 ms), level at 64 (36.0 / 35.3), behind at 96 (57.6 / 48.0);
# Q5_K level at 64 (36.1 / 37.0), behind at 96 (58.9 / 53.7). Their row-at-a-time kernel is gone
# from VNNI CPUs (it remains for a matrix whose rows are not a whole number of groups, under the
# grouped limit).
ALL_ROWS = 1 << 20
F32_GEMV_ROWS = {
    "grouped": {**dict.fromkeys(("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k"), ALL_ROWS),
                "q5_k": 64, "q6_k": 64},
    "vnni": {"int8": ALL_ROWS, "bf16": 16},
    # from 8 rows the AVX2 GEMV is the panel (csrc/panel_gemv.cpp): ahead of fp32 tiles to 256
    # rows for every format (Intel Xeon model 167 capped at avx2, 2 threads, --shapes down, ms
    # at 256 rows: Q8_0 63.8 / 80.9, Q4_K 67.1 / 79.9, Q6_K 76.8 / 81.9), level at 384 (Q6_K
    # behind: 131 / 110); it replaced row-at-a-time kernels that crossed at 20-64 rows
    "avx2": {**dict.fromkeys(("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "int8"),
                             256), "bf16": 16},
}
# The same crossovers for the GEMV on int8 activations (opt-in: ActWidth.INT8, QuantLinear's
# INT8_ACTS_BIT; docs/quantization.md, "int8 activations", has the table and why it is not the
# default), measured the same way (1 thread, loaded, --shapes down and the model's shapes):
# the grouped byte mode beats fp32 tiles at every row count (1.45x the int16 grouped GEMV at 64
# rows); on AVX2 the maddubs GEMV beats them up to 64 rows for Q8_0/Q4_0 (39.9 and 35.7 against
# 45.5 and 49.5 ms at 64), to ~48 for Q4_K (22.9 against 24.7 at 32, 47.6 against 44.7 at 64);
# grouped Q6_K and Q5_K (the Intel Xeon above) to the 128 rows measured (Q6_K 56.5 against 58.3
# ms, Q5_K 57.2 against 67.5).
# Formats without an int8 kernel keep their F32_GEMV_ROWS entry.
# On AVX2 the byte GEMV runs below 8 rows only; from there the byte panel (not Q8_0)
# or the int16 panel, both ahead of fp32 tiles to 256 rows and beyond (the byte panel at 512 rows:
# 338 against 721 ms a pass, Q4_1, the bundled model's shapes; AMD EPYC Zen 5 capped at avx2,
# 2 threads), so the crossovers are F32_GEMV_ROWS's.
F32_GEMV_ROWS_INT8 = {
    "grouped": {**dict.fromkeys(("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k"), ALL_ROWS),
                "q5_k": 128, "q6_k": 128},
}
# The 32-element block formats' and the K-quants' GEMV on AVX-512 VNNI reads rows grouped 16 at a time
# (csrc/group_gemv.cpp): it shares each weight load among 8 activation rows at ~1/3 of the
# row-at-a-time kernel's cost per row, and beats the GEMM up to these many rows (quant_bench, ms
# per pass at 16/24/32 rows, Q4_1: grouped GEMV 28.7/41.7/53.2, GEMM bf16 38.3/46.9/46.5, bf16x2
# 45.9/64.1/63.4, bf16x3 59.6/82.4/82.0). A matrix whose rows are not a whole number of groups
# keeps the row-at-a-time GEMV under the same limit (no model we know has one). Under bf16 and
# bf16x3 every format takes the same limit (not measured per format); bf16x2's are per format.
GROUPED_FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")
# The formats whose GEMV has an int8-activation kernel, per GEMV kind (csrc/byte_gemv.cpp and,
# from 8 rows, csrc/byte_panel.cpp (not Q8_0) for AVX2; csrc/group_gemv.cpp's byte mode for
# VNNI); the others keep int16 activations.
INT8_FORMATS = {"grouped": GROUPED_FORMATS,
                "avx2": ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q6_k")}
# csrc/byte_panel.cpp's: the AVX2 int8 formats whose codes are unsigned (all but Q8_0)
BYTE_PANEL_FORMATS = tuple(f for f in INT8_FORMATS["avx2"] if f != "q8_0")
# At avx512 these formats' 1-7 rows keep their 512-bit int16 kernels whatever width was asked
# for (csrc/quant_gemv.cpp: as fast as or faster than the 256-bit byte GEMV there, and finer)
WIDE_INT16_ROWS = ("q4_k", "q6_k")
# The default bf16x2's limits per format, measured again on the same Xeon on 6 December 2026
# (quant_kernels, ms a pass at 33 / 40 / 48 rows against the tiles at their padded 48: Q4_1
# 29.2 / 32.8 / 38.7 against 43.5, Q8_0 35.5 / 40.9 / 44.8 against 46.4, Q5_0 41.5 against 41.9 at
# 48; Q4_K 7.24 / 8.49 / 10.1 against 9.35, Q5_K alike; Q6_K 9.23 against 8.51 at 32, 10.4
# against 10.0 at 40): the grouped GEMV had grown faster (transposed from 2 rows, prefetching
# 8 KB ahead) since 32 was set for every format on 4 December.
GROUPED_GEMV_ROWS = {
    "bf16": dict.fromkeys(GROUPED_FORMATS, 24),
    "bf16x2": {**dict.fromkeys(("q4_0", "q4_1", "q5_0", "q5_1", "q8_0"), 48),
               "q4_k": 40, "q5_k": 40, "q6_k": 32},
    "bf16x3": dict.fromkeys(GROUPED_FORMATS, 40),
}
PACKED_FORMATS = tuple(GEMV_ROWS)
# The packed GEMM's precisions (EngineConfig.packed_gemm_precision names the same ones and the
# same default, which docs/quantization.md justifies with the fidelity and speed figures).
PACKED_PRECISIONS = {"bf16": GemmPrecision.BF16, "bf16x2": GemmPrecision.BF16X2,
                     "bf16x3": GemmPrecision.BF16X3, "fp32": GemmPrecision.F32}
TILE_PRECISIONS = ("bf16", "bf16x2", "bf16x3")  # bf16 tiles: AMX only
assert tuple(PACKED_PRECISIONS) == PACKED_GEMM_PRECISIONS, "EngineConfig's names are these"


def _gemv_rows(fmt: str, rows: int, precision: str, grouped: bool, int8: bool = False) -> int:
    """The row count up to which ``fmt``'s packed GEMV runs (GEMV_ROWS and its exceptions;
    ``grouped``: the CPU runs the grouped GEMV; ``precision`` the GEMM's; ``int8``: the GEMV
    rounds activations to int8, where ``fmt`` has such a kernel)."""
    if fmt == "float32":
        return rows
    if precision == "fp32":
        kind = ("grouped" if fmt in GROUPED_FORMATS else "vnni") if grouped else "avx2"
        if int8 and fmt in F32_GEMV_ROWS_INT8.get(kind, {}):
            return F32_GEMV_ROWS_INT8[kind][fmt]
        return F32_GEMV_ROWS[kind][fmt]
    if grouped and fmt in GROUPED_FORMATS:
        return GROUPED_GEMV_ROWS[precision][fmt]
    if fmt == "bf16":  # exact bf16 rows: every precision multiplies them alike
        return rows
    return max(rows, BF16X3_GEMV_ROWS) if precision == "bf16x3" else rows


@dataclass(frozen=True)
class PackedChoice:
    """How ``x @ W.T`` runs for a weight kept in a packed format (pagedq.kernels.block_formats).

    ``kind`` "cpp": the packed GEMV (integer dot products, ``isa``) for steps of at most
    ``gemv_rows`` rows, the bf16-tile GEMM in ``precision`` (a PACKED_PRECISIONS name) for more;
    "triton": the weight-only Triton GEMM; "torch": dequantized per call for ``F.linear`` (runs
    anywhere, slowly).
    """

    weight_format: str
    kind: str
    gemv_rows: int = 0
    isa: int = 0
    ops: CpuOps | None = field(default=None, compare=False, repr=False)
    precision: str = DEFAULT_PACKED_PRECISION
    int8_acts: bool = False  # the GEMV rounds activations to int8 (an INT8_FORMATS format)
    # QuantLinear's ``precision``: the GEMM's GemmPrecision with INT8_ACTS_BIT when the GEMV
    # takes int8 activations; derived from the two above when the choice is made, so building a
    # projection reads it and asks nothing
    precision_code: int = field(init=False)

    def __post_init__(self) -> None:
        code = int(PACKED_PRECISIONS[self.precision]) | (INT8_ACTS_BIT if self.int8_acts else 0)
        object.__setattr__(self, "precision_code", code)

    @property
    def name(self) -> str:
        if self.kind != "cpp":
            return {"triton": "triton-wq", "torch": "torch-dequant"}[self.kind]
        first = panel_from(self.weight_format, self.isa)
        name, panel = self.kernel(1), self.kernel(first)
        if first <= self.gemv_rows and panel != name:  # the AVX2 panel from its first row on
            name = f"{name}<{first}+{panel}"
        wide = self.kernel(WIDE_PANEL_ROWS)
        if WIDE_PANEL_ROWS <= self.gemv_rows and wide != panel:  # ... in AVX-512 from 12 rows
            name = f"{name}<{WIDE_PANEL_ROWS}+{wide}"
        return f"{name}<={self.gemv_rows}+{self.kernel(self.gemv_rows + 1)}"

    def kernel(self, rows: int) -> str:
        """What runs for a step of ``rows`` rows."""
        if self.kind != "cpp":
            return self.name
        if self.weight_format == "float32":  # a widened tensor among packed ones
            return "cpp-skinny" if rows <= self.gemv_rows else "torch"
        if rows <= self.gemv_rows:
            if self.isa == Isa.AVX512_VNNI:
                return "cpp-gemv-vnni" + ("-int8" if self.int8_acts else "")
            if rows >= panel_from(self.weight_format, self.isa) and self.weight_format != "bf16":
                # int8 activations where asked for and the format's codes are unsigned
                # (csrc/byte_panel.cpp, from PANEL_ROWS at every level: Q6_K's 5-7 rows keep
                # int16); else int16, 16 rows a vector with AVX-512BW from WIDE_PANEL_ROWS
                # (csrc/panel_gemv512.cpp)
                bytes_ = self.int8_acts and self.weight_format in BYTE_PANEL_FORMATS
                if bytes_ and rows >= PANEL_ROWS:
                    return "cpp-panel-avx2-int8"
                wide = self.isa == Isa.AVX512 and rows >= WIDE_PANEL_ROWS
                if wide:
                    return "cpp-panel-avx512"
                return "cpp-panel-avx2-vnni" if self.isa == Isa.AVX2_VNNI else "cpp-panel-avx2"
            wide_rows = self.isa == Isa.AVX512 and self.weight_format in WIDE_INT16_ROWS
            return "cpp-gemv-avx2" + ("-int8" if self.int8_acts and not wide_rows else "")
        return f"cpp-gemm-{self.precision}"


@dataclass(frozen=True)
class Backend:
    """The kernels chosen for one model on one device (see the module docstring for the names)."""

    device: str
    dtype: torch.dtype
    attention: str
    kv_write: str
    linears: tuple[LinearChoice, ...]
    packed: tuple[PackedChoice, ...] = ()
    norm: str = "torch"
    layer: str = "python"
    reasons: tuple[str, ...] = ()  # why: one line per decision, for the start-up log
    cpu: CpuFeatures | None = None
    ops: CpuOps | None = field(default=None, compare=False, repr=False)

    def linear_for(self, weight_format: str) -> LinearChoice:
        """The choice for weights of ``weight_format`` (``F.linear`` for a format it lacks)."""
        for choice in self.linears:
            if choice.weight_format == weight_format:
                return choice
        return LinearChoice(weight_format, "torch")

    def packed_for(self, weight_format: str) -> PackedChoice:
        """The choice for packed weights of ``weight_format`` (dequantize-per-call if none)."""
        for choice in self.packed:
            if choice.weight_format == weight_format:
                return choice
        return PackedChoice(weight_format, "torch")

    def summary(self) -> dict[str, str]:
        """What runs, by kind of work: the fields of the start-up log line."""
        return {"device": self.device, "dtype": str(self.dtype).removeprefix("torch."),
                "attention": self.attention, "kv_write": self.kv_write,
                "linear": ", ".join(f"{c.weight_format}: {c.name}" for c in self.linears),
                "packed": _packed_summary(self.packed),
                "norm": self.norm, "layer": self.layer,
                "cpu": self.cpu.summary() if self.cpu else "-"}

    def plan(self) -> KernelPlan:
        """These choices resolved for a model computing in ``dtype``: the route of its float
        weights and of every packed format, looked up once here."""
        return KernelPlan(self, self.linear_for(_format(self.dtype)),
                          {f: self.packed_for(f) for f in PACKED_FORMATS})


@dataclass(frozen=True)
class KernelPlan:
    """What a model is built and packed for (:meth:`Backend.plan`): the backend, the linear
    its float weights take (they are in the backend's dtype, the compute dtype) and the route
    of each packed format (every segment a checkpoint can hold: PACKED_FORMATS). The models
    layer builds every layer and projection from this, asking the selector nothing more."""

    backend: Backend
    linear: LinearChoice
    packed: dict[str, PackedChoice]


def _packed_summary(choices: tuple[PackedChoice, ...]) -> str:
    """One entry per distinct route: "q4_0/q4_1/...: cpp-gemv-vnni<=4+cpp-gemm-bf16"."""
    routes: dict[str, list[str]] = {}
    for choice in choices:
        routes.setdefault(choice.name, []).append(choice.weight_format)
    return ", ".join(f"{'/'.join(formats)}: {name}" for name, formats in routes.items()) or "-"


def portable_backend(device: torch.device | str, dtype: torch.dtype) -> Backend:
    """Only PyTorch's own kernels: they run anywhere, with nothing to build or detect."""
    name = torch.device(device).type
    return Backend(name, dtype, "sdpa", "torch", (LinearChoice(_format(dtype), "torch"),),
                   reasons=("the portable PyTorch kernels",))


def _format(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Selector:
    """Chooses a :class:`Backend` from the device, dtypes, CPU features and switches.

    ``cpu`` defaults to this machine's features; ``has_triton`` to whether triton imports.
    """

    def __init__(self, switches: Switches | None = None, cpu: CpuFeatures | None = None,
                 has_triton: bool | None = None, cpu_isa: str = "auto") -> None:
        self.switches = switches or Switches()
        self.cpu = (cpu or process_cpu()).capped(cpu_isa)
        self._has_triton = has_triton

    @property
    def has_triton(self) -> bool:
        """Whether triton imports, asked only for an accelerator: importing it costs ~65 MB
        resident, which a CPU engine never uses."""
        if self._has_triton is None:
            self._has_triton = triton_available()
        return self._has_triton

    def library(self) -> CpuOps | None:
        """The C++ ops when this CPU runs them and they build; None otherwise."""
        return load_cpu_ops(self.switches.extensions_dir) if self.cpu.runs_cpp_kernels else None

    def ops_for(self, device: torch.device | str) -> CpuOps | None:
        """The C++ ops a model on ``device`` may run, built or loaded by the process's first
        call: None off the CPU, with the C++ kernels switched off, where this CPU lacks their
        extensions or where the build failed."""
        if torch.device(device).type != "cpu" or not self.switches.cpu_kernels:
            return None
        return self.library()

    def select(self, device: torch.device | str, dtype: torch.dtype = torch.float32,
               kv_dtype: torch.dtype | None = None, head_dim: int | None = None,
               packed_precision: str = DEFAULT_PACKED_PRECISION,
               packed_activations: str = "int16") -> Backend:
        """The kernels for a ``dtype`` model with a ``kv_dtype`` cache (default: ``dtype``) and
        ``head_dim``-wide heads (None: any the kernels take) on ``device``, the packed GEMM in
        ``packed_precision``, the packed GEMV on ``packed_activations``; logs one line."""
        if packed_precision not in PACKED_PRECISIONS:
            raise ValueError(f"packed_precision must be one of {tuple(PACKED_PRECISIONS)}, "
                             f"got {packed_precision!r}")
        if packed_activations not in PACKED_ACTIVATIONS:
            raise ValueError(f"packed_activations must be one of {PACKED_ACTIVATIONS}, "
                             f"got {packed_activations!r}")
        device = torch.device(device)
        if device.type == "cpu":
            backend = self._cpu(dtype, kv_dtype or dtype, head_dim, packed_precision,
                                packed_activations == "int8")
        else:
            backend = self._accelerator(device.type, dtype)
        _log.info("kernel_backend", **backend.summary(), why="; ".join(backend.reasons))
        return backend

    def _accelerator(self, device: str, dtype: torch.dtype) -> Backend:
        use = self.has_triton and device == "cuda"
        why = "triton imports" if use else f"Triton kernels need CUDA and the triton package on {device}"
        kernels = "triton" if use else None
        packed = tuple(PackedChoice(f, kernels or "torch") for f in PACKED_FORMATS)
        return Backend(device, dtype, kernels or "sdpa", kernels or "torch",
                       (LinearChoice(_format(dtype), "torch"),), packed, reasons=(why,))

    def _cpu(self, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int | None,
             precision: str, int8: bool = False) -> Backend:
        reasons: list[str] = []
        ops = self._cpu_ops(reasons)
        attention = "sdpa"
        if ops is not None:
            why_not = unsupported(dtype, kv_dtype, head_dim)
            attention = "sdpa" if why_not else "cpp"
            reasons.append(why_not or "C++ attention kernel (SDPA for long prefill chunks)")
        fp32_ops = ops if dtype == torch.float32 else None
        if ops is not None and fp32_ops is None:
            reasons.append("the C++ GEMV, RMSNorm and fused layer take float32 models only")
        linear = self._cpu_linear(dtype, fp32_ops, reasons)
        layer = "python"
        if fp32_ops is not None and attention == "cpp":
            layer = "cpp-fused" if self.switches.fused_layer else "python"
            if layer == "python":
                reasons.append("--no-fused-layer (PAGEDQ_FUSED_LAYER=0) keeps the per-op "
                               "Python layer")
        packed = self._cpu_packed(fp32_ops, precision, reasons, int8)
        return Backend("cpu", dtype, attention, "torch", (linear,), packed,
                       norm="cpp" if fp32_ops is not None else "torch", layer=layer,
                       reasons=tuple(reasons), cpu=self.cpu, ops=ops)

    def _cpu_ops(self, reasons: list[str]) -> CpuOps | None:
        """The C++ library, when the switch, the CPU and the build allow it."""
        if not self.switches.cpu_kernels:
            reasons.append("--no-cpu-kernels (PAGEDQ_CPU_KERNEL=0) switches the C++ kernels off")
            return None
        if not self.cpu.runs_cpp_kernels:
            reasons.append(f"no C++ kernels: {self.cpu.missing_for_kernels()}")
            return None
        ops = self.library()
        if ops is None:
            reasons.append(f"no C++ kernels: {unavailable_reason()}")
        return ops

    def _cpu_linear(self, dtype: torch.dtype, ops: CpuOps | None, reasons: list[str]) -> LinearChoice:
        onednn = dtype == torch.float32 and torch.backends.mkldnn.is_available()
        if onednn and not self.switches.onednn:
            onednn = False
            reasons.append("--no-onednn (PAGEDQ_ONEDNN=0): batched linears use F.linear")
        batched = "onednn" if onednn else "torch"
        if ops is None:
            return LinearChoice(_format(dtype), batched)
        isa = "avx512" if self.cpu.has_avx512 else "avx2"
        reasons.append(f"skinny GEMV tiles in {isa.upper()}")
        return LinearChoice(_format(dtype), batched, f"cpp-skinny-{isa}", SKINNY_MAX_ROWS, ops)


    def packed_isa(self) -> int:
        """The packed kernels' ``isa``: VNNI's grouped GEMV, else the AVX2 GEMV with its
        many-row panel in AVX-512BW where the CPU has it, or on AVX-VNNI's vpdpwssd (an Intel
        Core without AVX-512), else all AVX2."""
        return int(Isa.AVX512_VNNI if self.cpu.has_avx512_vnni else
                   Isa.AVX512 if self.cpu.has_wide_panel else
                   Isa.AVX2_VNNI if self.cpu.has_avx_vnni else Isa.AVX2)

    def _cpu_packed(self, ops: CpuOps | None, precision: str, reasons: list[str],
                    int8: bool = False) -> tuple[PackedChoice, ...]:
        """The packed formats' routes: the C++ GEMV/GEMM pair where the library runs (it takes
        float32 activations), else dequantize per call; ``int8``: the GEMV on int8 activations
        for the formats that have such a kernel at this level."""
        if ops is None:
            return tuple(PackedChoice(f, "torch") for f in PACKED_FORMATS)
        isa = self.packed_isa()
        # A described CPU (tests, CpuFeatures.of) is taken at its word; this machine's AMX is
        # also asked of torch (ONEDNN_MAX_CPU_ISA can hide it from oneDNN's brgemm).
        tiles = self.cpu.has_amx and (ops.bf16_tiles or self.cpu.source == "given")
        if precision in TILE_PRECISIONS and not tiles:
            why = ("AMX hidden by ONEDNN_MAX_CPU_ISA" if self.cpu.has_amx
                   else f"no AMX at level {self.cpu.level}")
            reasons.append(f"packed GEMM: fp32 tiles, not {precision} ({why}: torch runs bf16 "
                           "tiles only with AMX)")
            precision = "fp32"
        gemv = {Isa.AVX512_VNNI: "AVX-512 VNNI", Isa.AVX512: "AVX2 (the panel in AVX-512BW)",
                Isa.AVX2_VNNI: "AVX2 (the panel on AVX-VNNI)", Isa.AVX2: "AVX2"}[isa]
        reasons.append(f"packed weights: GEMV in {gemv}, "
                       f"GEMM on {precision} tiles")
        grouped = isa == Isa.AVX512_VNNI
        bytes_ = INT8_FORMATS["grouped" if grouped else "avx2"] if int8 else ()
        if int8:
            reasons.append(f"packed GEMV on int8 activations for {'/'.join(bytes_)} "
                           "(--packed-activations int8)")
        return tuple(PackedChoice(f, "cpp", _gemv_rows(f, rows, precision, grouped, f in bytes_),
                                  isa, ops, precision, f in bytes_)
                     for f, rows in GEMV_ROWS.items())

    def compute_dtype(self, device: torch.device | str, dtype: torch.dtype,
                      packed: bool = False) -> torch.dtype:
        """The activations' dtype for a ``dtype`` model (``packed``: its weights stay packed).

        On a CPU whose C++ kernels run, packed weights compute in float32 (the kernels' input),
        and so does a bfloat16 model where the CPU multiplies bf16 in hardware (AMX,
        AVX512_BF16): it keeps bf16 weight rows, packed, and gets the fused layer, the C++
        attention, the packed GEMV for decode and bf16 tiles for prefill. Elsewhere a model
        computes in its own dtype."""
        if torch.device(device).type != "cpu" or dtype == torch.float32:
            return dtype
        bf16_rows = dtype == torch.bfloat16 and self.cpu.has_bf16_matmul
        if (packed or bf16_rows) and self.ops_for(device) is not None:
            return torch.float32
        return dtype


@functools.cache
def process_cpu() -> CpuFeatures:
    """This machine's features as this process may use them: capped at PAGEDQ_CPU_ISA when set
    (as the C++ ops cap themselves), so every Selector of a capped process, and every test that
    asks what this CPU runs, sees the capped machine."""
    return detect_cpu_features().capped(environment_switches().cpu_isa)


@functools.cache
def process_selector(cpu_isa: str = "auto", switches: Switches | None = None) -> Selector:
    """The selector of an engine in this process: ``switches`` (EngineConfig.kernel_switches();
    default: the environment's, read once) and this CPU, capped at ``cpu_isa``
    (EngineConfig.cpu_isa). One per combination, so its C++ library loads once."""
    return Selector(switches or environment_switches(), cpu_isa=cpu_isa)


def select_backend(device: torch.device | str, dtype: torch.dtype = torch.float32,
                   kv_dtype: torch.dtype | None = None, head_dim: int | None = None,
                   packed_precision: str = DEFAULT_PACKED_PRECISION,
                   cpu_isa: str = "auto", switches: Switches | None = None,
                   packed_activations: str = "int16") -> Backend:
    """:meth:`Selector.select` of :func:`process_selector`: what the engine runs at start."""
    return process_selector(cpu_isa, switches).select(device, dtype, kv_dtype, head_dim,
                                                      packed_precision, packed_activations)


@functools.cache
def default_attention(device: str, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> str:
    """The attention ``paged_attention(backend=None)`` runs for such tensors (chosen once per
    combination, as the engine would choose it)."""
    return select_backend(device, dtype, kv_dtype, head_dim).attention
