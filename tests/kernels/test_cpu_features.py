"""CPU feature detection (kernels/cpu_features.py): /proc/cpuinfo, or torch's level elsewhere."""

from __future__ import annotations

import torch

from pagedq.kernels import cpu_features
from pagedq.kernels.cpu_features import CpuFeatures, detect_cpu_features

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
                         "amx_int8"}
    assert cpu.runs_cpp_kernels and cpu.has_avx512 and cpu.source == str(path)
    assert cpu.summary() == "avx2 fma f16c avx512f avx512vl avx512dq avx512_vnni amx_int8"


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
