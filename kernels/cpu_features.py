"""The x86 vector extensions of this CPU, detected once at run time, and the ISA levels.

The C++ library is built for AVX2 + FMA + F16C, so it runs only where the CPU has all three. The
skinny GEMV also has AVX-512F tiles (they need VL and DQ too), chosen per call; the packed-weight
GEMV's AVX-512 path needs BW and VNNI as well. AMX decides whether many-row steps over packed
weights multiply bf16 tiles (oneDNN's brgemm, which torch runs only with AMX) or fp32 ones.

The kernels come in five **levels**, lowest first (:data:`ISA_LEVELS`): ``avx2`` (AVX2, FMA,
F16C: a Zen 2/3, a Haswell), ``avx2_vnni`` (+ AVX-VNNI, the 256-bit VEX vpdpwssd: Intel Core from
Alder Lake on, which has no AVX-512; the packed GEMV's many-row panel fuses its multiply-adds),
``avx512`` (+ AVX-512 F/VL/DQ/BW: the skinny GEMV's wide tiles), ``avx512_vnni`` (+ VNNI, and
AVX512_BF16 where present: the packed GEMV's integer dot products, rows grouped 16 at a time) and
``amx`` (+ AMX tiles: the bf16-tile GEMM). ``avx2_vnni`` sits beside the AVX-512 chain, not
below it: a Skylake-X or an Ice Lake runs ``avx512`` / ``avx512_vnni`` without it, and a cap at
those hides AVX-VNNI as it would be hidden there. ``CpuFeatures.capped(level)`` hides every
flag the level's CPUs lack, so an AMX machine runs (and tests) exactly what an AVX2 machine runs:
``EngineConfig.cpu_isa`` / ``--cpu-isa`` set the cap.

Linux lists the flags in /proc/cpuinfo. Elsewhere torch's own dispatch level
(``torch.backends.cpu.get_cpu_capability()``) stands in: it tells AVX2 from AVX-512 but not the
newer extensions, which then count as absent (a safe answer: nothing needs them yet).
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

# The flags worth knowing, in /proc/cpuinfo's spelling, in the order the log lists them.
FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512vl", "avx512dq", "avx512bw",
         "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
KERNEL_FLAGS = frozenset({"avx2", "fma", "f16c"})  # what the whole C++ library is built for
AVX512_FLAGS = frozenset({"avx512f", "avx512vl", "avx512dq"})  # the GEMV's AVX-512 tiles
VNNI_FLAGS = AVX512_FLAGS | {"avx512bw", "avx512_vnni"}  # the packed-weight kernels' AVX-512 path
AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})  # the bf16-tile GEMM (oneDNN's brgemm)
X86_64 = ("x86_64", "amd64")
AVX_VNNI_FLAGS = frozenset({"avx_vnni"})  # the AVX2 panel's vpdpwssd (csrc/panel_gemv_vnni.cpp)
ISA_LEVELS = ("avx2", "avx2_vnni", "avx512", "avx512_vnni", "amx")
# What a CPU needs to run each level, and what a cap at that level leaves visible (a level's
# optional extras, like AVX512_BF16 beside VNNI, stay where the CPU has them).
LEVEL_NEEDS = {"avx2": KERNEL_FLAGS, "avx2_vnni": KERNEL_FLAGS | AVX_VNNI_FLAGS,
               "avx512": KERNEL_FLAGS | AVX512_FLAGS,
               "avx512_vnni": KERNEL_FLAGS | VNNI_FLAGS,
               "amx": KERNEL_FLAGS | VNNI_FLAGS | AMX_FLAGS}
LEVEL_KEEPS = {"avx2": KERNEL_FLAGS, "avx2_vnni": KERNEL_FLAGS | AVX_VNNI_FLAGS,
               "avx512": KERNEL_FLAGS | AVX512_FLAGS | {"avx512bw"},
               "avx512_vnni": KERNEL_FLAGS | VNNI_FLAGS | {"avx512_bf16"},
               "amx": frozenset(FLAGS)}


class UnsupportedIsaError(ValueError):
    """A cap above what this CPU runs, or a name that is no level; the message lists the levels."""
# What each of torch's dispatch levels implies (its AVX512 level needs F, BW, VL and DQ).
TORCH_CAPABILITY_FLAGS = {
    "AVX2": KERNEL_FLAGS,
    "AVX512": KERNEL_FLAGS | AVX512_FLAGS,
}


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU's architecture and the :data:`FLAGS` it has, and where they were read."""

    arch: str
    flags: frozenset[str]
    source: str  # "/proc/cpuinfo", "torch capability AVX512", ...

    @classmethod
    def of(cls, *flags: str, arch: str = "x86_64") -> CpuFeatures:
        """A CPU with exactly these flags (tests describe machines they do not run on)."""
        return cls(arch, frozenset(flags), "given")

    @property
    def runs_cpp_kernels(self) -> bool:
        return self.arch.lower() in X86_64 and KERNEL_FLAGS <= self.flags

    @property
    def has_avx512(self) -> bool:
        return AVX512_FLAGS <= self.flags

    @property
    def has_wide_panel(self) -> bool:
        """AVX-512 with BW, without VNNI: the AVX2 GEMV's many-row panel runs 16 rows a vector
        (csrc/panel_gemv512.cpp; VNNI CPUs take the grouped GEMV instead)."""
        return self.has_avx512 and "avx512bw" in self.flags and not self.has_avx512_vnni

    @property
    def has_avx512_vnni(self) -> bool:
        return VNNI_FLAGS <= self.flags

    @property
    def has_avx_vnni(self) -> bool:
        """AVX-VNNI (the VEX-encoded 256-bit vpdpwssd): the AVX2 panel fuses its multiply-adds."""
        return KERNEL_FLAGS | AVX_VNNI_FLAGS <= self.flags

    @property
    def has_amx(self) -> bool:
        """AMX bf16 tiles: the packed GEMM's bf16 precisions (oneDNN's brgemm) run here."""
        return AMX_FLAGS <= self.flags

    @property
    def levels(self) -> tuple[str, ...]:
        """The ISA levels this CPU runs, lowest first (none where the C++ kernels cannot run)."""
        if self.arch.lower() not in X86_64:
            return ()
        return tuple(level for level in ISA_LEVELS if LEVEL_NEEDS[level] <= self.flags)

    @property
    def level(self) -> str | None:
        """The highest level this CPU runs (None: not even AVX2)."""
        return self.levels[-1] if self.levels else None

    def capped(self, level: str) -> CpuFeatures:
        """This CPU as one of ``level`` would look ("auto": itself): every flag above the level
        hidden. Raises :class:`UnsupportedIsaError` for a level this CPU does not run."""
        if level == "auto":
            return self
        if level not in ISA_LEVELS:
            raise UnsupportedIsaError(f"cpu_isa must be auto or one of {', '.join(ISA_LEVELS)}, "
                                      f"got {level!r}")
        if level not in self.levels:
            runs = ", ".join(self.levels) or "none (no AVX2)"
            raise UnsupportedIsaError(f"cpu_isa={level} needs {' '.join(sorted(LEVEL_NEEDS[level]))}; "
                                      f"this CPU runs: {runs}. Pick one of those, or auto")
        return CpuFeatures(self.arch, self.flags & LEVEL_KEEPS[level],
                           f"{self.source}, capped at {level}")

    @property
    def has_bf16_matmul(self) -> bool:
        """bf16 products in hardware (AMX tiles or AVX-512 BF16): oneDNN's bf16 kernels, and so
        the packed weights' many-row GEMM, run an order of magnitude faster than fp32 there."""
        return "amx_bf16" in self.flags or "avx512_bf16" in self.flags

    def missing_for_kernels(self) -> str:
        """Why the C++ library cannot run here ("" when it can)."""
        if self.arch.lower() not in X86_64:
            return f"the CPU architecture {self.arch} is not x86-64"
        missing = sorted(KERNEL_FLAGS - self.flags)
        return f"the CPU lacks {', '.join(missing)}" if missing else ""

    def summary(self) -> str:
        """The known flags this CPU has, space-separated, for the start-up log."""
        return " ".join(f for f in FLAGS if f in self.flags) or "none of " + "/".join(FLAGS[:4])


def detect_cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuFeatures:
    """This machine's features: /proc/cpuinfo's flags, else torch's capability level."""
    arch = platform.machine()
    try:
        line = next(ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        if arch.lower() not in X86_64:
            return CpuFeatures(arch, frozenset(), "platform")
        capability = torch.backends.cpu.get_cpu_capability()
        return CpuFeatures(arch, TORCH_CAPABILITY_FLAGS.get(capability, frozenset()),
                           f"torch capability {capability}")
    return CpuFeatures(arch, frozenset(line.split(":", 1)[1].split()) & frozenset(FLAGS), str(cpuinfo))


IDENTITY_FIELDS = ("model name", "cpu family", "model", "stepping")


@functools.cache
def cpuinfo_fields(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The first processor's ``name: value`` lines of /proc/cpuinfo ({} where there is none),
    read once a process."""
    fields: dict[str, str] = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            if not line.strip():
                break  # the first processor's block is enough
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_identity(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """This CPU's name, family, model and stepping as /proc/cpuinfo gives them ("AMD EPYC,
    26, 2, 1"; platform.processor() elsewhere): what figures measured per machine are kept
    under (kernels/crossover.py)."""
    fields = cpuinfo_fields(cpuinfo)
    found = [fields[f] for f in IDENTITY_FIELDS if f in fields]
    return ", ".join(found) or platform.processor() or platform.machine()


# What each level hides from the libraries under torch too, for a process that should run as a
# CPU of that level would (tests/kernels/test_isa_levels.py, the bench's capped runs): oneDNN
# (fp32 linears, brgemm), ATen's own vector kernels and MKL read these once at start.
LEVEL_ENVIRONMENT = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx2_vnni": {"ONEDNN_MAX_CPU_ISA": "AVX2_VNNI", "ATEN_CPU_CAPABILITY": "avx2",
                  "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx512",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx512_vnni": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "ATEN_CPU_CAPABILITY": "avx512",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "amx": {},
}


def isa_environment(level: str) -> dict[str, str]:
    """The environment of a process capped at ``level``: PAGEDQ_CPU_ISA for pagedq's kernels
    (Python and C++) and :data:`LEVEL_ENVIRONMENT`'s caps for oneDNN, ATen and MKL."""
    if level not in ISA_LEVELS:
        raise UnsupportedIsaError(f"cpu_isa must be one of {', '.join(ISA_LEVELS)}, got {level!r}")
    return {"PAGEDQ_CPU_ISA": level, **LEVEL_ENVIRONMENT[level]}


def cpu_isa_levels() -> tuple[str, ...]:
    """The ISA levels this machine runs, lowest first: every one can be set as ``cpu_isa``."""
    return detect_cpu_features().levels
