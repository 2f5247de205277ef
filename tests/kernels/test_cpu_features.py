"""CPU feature detection (kernels/cpu_features.py): /proc/cpuinfo, or torch's level elsewhere."""

from __future__ import annotations

import pytest
import torch

from pagedq.kernels import cpu_features
from pagedq.kernels.cpu_features import (
    ISA_LEVELS,
    CpuFeatures,
    UnsupportedIsaError,
    cpu_isa_levels,
    detect_cpu_features,
)

CPUINFO = """processor\t: 0
model name\t: Some Xeon
flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512dq avx512vl avx512_vnni amx_int8 amx_tile
"""


def test_flags_come_from_cpuinfo(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_features.platform, "machine", lambda: "x86_64")
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    cpu = detect_cpu_features(path)
    assert cpu.flags == {"avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512vl", "avx512_vnni",
                         "amx_int8", "amx_tile"}
    assert cpu.runs_cpp_kernels and cpu.has_avx512 and cpu.source == str(path)
    assert cpu.summary() == "avx2 fma f16c avx512f avx512vl avx512dq avx512_vnni amx_tile amx_int8"


def test_without_cpuinfo_torch_capability_stands_in(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_features.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    cpu = detect_cpu_features(tmp_path / "missing")
    assert cpu.runs_cpp_kernels and not cpu.has_avx512 and cpu.source == "torch capability AVX2"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert not detect_cpu_features(tmp_path / "missing").runs_cpp_kernels


def test_other_architectures_run_no_cpp_kernels(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_features.platform, "machine", lambda: "aarch64")
    cpu = detect_cpu_features(tmp_path / "missing")
    assert not cpu.runs_cpp_kernels and "aarch64 is not x86-64" in cpu.missing_for_kernels()


def test_what_a_cpu_lacks_is_named():
    assert CpuFeatures.of("avx2").missing_for_kernels() == "the CPU lacks f16c, fma"
    assert CpuFeatures.of("avx2", "fma", "f16c").missing_for_kernels() == ""
    assert CpuFeatures.of().summary().startswith("none of")


def test_this_machine_agrees_with_torch():
    """What torch's own dispatch found, detection finds too."""
    cpu = detect_cpu_features()
    level = torch.backends.cpu.get_cpu_capability()
    if level in ("AVX2", "AVX512"):
        assert cpu.runs_cpp_kernels
    if level == "AVX512":
        assert cpu.has_avx512


ZEN4 = CpuFeatures.of("avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512dq", "avx512bw",
                      "avx512_vnni", "avx512_bf16")
SAPPHIRE_RAPIDS = CpuFeatures.of(*ZEN4.flags, "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
ALDER_LAKE = CpuFeatures.of("avx2", "fma", "f16c", "avx_vnni")  # AVX-VNNI, no AVX-512


def test_levels_lowest_first():
    assert SAPPHIRE_RAPIDS.levels == ("avx2", "avx2_vnni", "avx512", "avx512_vnni", "amx")
    assert ALDER_LAKE.levels == ("avx2", "avx2_vnni") and ALDER_LAKE.level == "avx2_vnni"
    assert ZEN4.levels == ("avx2", "avx512", "avx512_vnni") and ZEN4.level == "avx512_vnni"
    assert CpuFeatures.of("avx2", "fma", "f16c").levels == ("avx2",)
    assert CpuFeatures.of("avx2").levels == () and CpuFeatures.of("avx2").level is None
    assert CpuFeatures.of(*ZEN4.flags, arch="aarch64").levels == ()


def test_a_cap_hides_every_flag_above_its_level():
    avx2 = SAPPHIRE_RAPIDS.capped("avx2")
    assert avx2.flags == {"avx2", "fma", "f16c"} and avx2.level == "avx2"
    assert not avx2.has_avx512 and not avx2.has_amx and not avx2.has_bf16_matmul
    assert "capped at avx2" in avx2.source
    avx512 = SAPPHIRE_RAPIDS.capped("avx512")
    assert avx512.has_avx512 and not avx512.has_avx512_vnni and avx512.level == "avx512"
    vnni = SAPPHIRE_RAPIDS.capped("avx512_vnni")
    assert vnni.has_avx512_vnni and "avx512_bf16" in vnni.flags and not vnni.has_amx
    assert not avx2.has_avx_vnni and not avx512.has_avx_vnni and not vnni.has_avx_vnni
    core = SAPPHIRE_RAPIDS.capped("avx2_vnni")  # what an Intel Core without AVX-512 runs
    assert core.flags == ALDER_LAKE.flags and core.has_avx_vnni and not core.has_avx512
    assert core.level == "avx2_vnni" and SAPPHIRE_RAPIDS.capped("amx").has_avx_vnni
    assert SAPPHIRE_RAPIDS.capped("amx") == SAPPHIRE_RAPIDS.capped("auto") or \
        SAPPHIRE_RAPIDS.capped("amx").flags == SAPPHIRE_RAPIDS.flags


def test_a_cap_above_the_cpu_is_refused_naming_what_it_runs():
    with pytest.raises(UnsupportedIsaError, match="this CPU runs: avx2, avx512, avx512_vnni"):
        ZEN4.capped("amx")
    with pytest.raises(UnsupportedIsaError, match="one of avx2, avx2_vnni, avx512"):
        ZEN4.capped("sse4")
    with pytest.raises(UnsupportedIsaError, match="this CPU runs: avx2, avx512, avx512_vnni"):
        ZEN4.capped("avx2_vnni")  # a Zen 4 has AVX-512 VNNI, not the VEX AVX-VNNI
    with pytest.raises(UnsupportedIsaError, match="this CPU runs: avx2, avx2_vnni"):
        ALDER_LAKE.capped("avx512")


def test_each_level_caps_the_libraries_under_torch_as_its_cpus_have_them():
    assert cpu_features.isa_environment("avx2_vnni") == {
        "PAGEDQ_CPU_ISA": "avx2_vnni", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI",
        "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert cpu_features.isa_environment("avx2")["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_this_machines_levels():
    """cpu_isa_levels() lists what this machine runs; the session's note says which ran."""
    levels = cpu_isa_levels()
    assert levels == detect_cpu_features().levels
    assert list(levels) == [lvl for lvl in ISA_LEVELS if lvl in levels]
