"""The CPU-safe parts of ``python -m pagedq.bench.kernel_check``: arguments, the no-CUDA exit and
compiling the Triton kernels for a GPU without one (``--compile-only``).

Its correctness checks run in tests/kernels/test_triton_cases.py on tiny shapes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedq.bench import kernel_check as check


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_and_exits_2():
    result = subprocess.run(
        [sys.executable, "-m", "pagedq.bench.kernel_check", "--quick"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == check.NO_CUDA_EXIT
    assert "No CUDA device" in result.stderr and "test_triton_interpreter.py" in result.stderr


def test_arguments():
    args = check.parse_args(["--dtypes", "fp16", "--quick", "--engine-model", "/m"])
    assert (args.dtypes, args.quick, args.engine_model) == ("fp16", True, "/m")
    with pytest.raises(SystemExit):
        check.parse_args(["--dtypes", "fp8"])


def test_peak_table_and_case_list():
    assert check.PEAK_TBPS["H200"] == 4.8 and check.PEAK_TBPS["A100"] < 2.1
    names = [name for name, *_ in check.correctness_cases(quick=False)]
    assert len(names) == len(set(names)) and any("split" in n for n in names)
    for _, q_lens, ctx, _ in check.correctness_cases(quick=False):
        assert len(q_lens) == len(ctx) and max(c + q for c, q in zip(ctx, q_lens, strict=True)) <= 32768


def test_triton_kernels_compile_for_hopper_without_a_gpu():
    """Lowering to sm_90 (the interpreter never exercises it): catches GPU-only compile errors."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "pagedq.bench.kernel_check", "--compile-only", "90", "--dtypes", "bf16"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert result.stdout.count("ok   compiled") == 8  # attention (3), merge+write, w4/w8 GEMM (4)
    assert "weight-only GEMM w4 BLOCK_M=16" in result.stdout


def test_cpu_benchmark_runs(capsys):
    """By default it times the selector's attention for the CPU beside SDPA; --paths picks."""
    from pagedq.bench import attention_kernels as bench
    from pagedq.kernels.backend import select_backend

    bench.main(["--batches", "1,3", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "decode b=3" in out and "prefill q=512" in out and "mixed" in out
    header = out.splitlines()[0]
    assert "ms sdpa" in header
    assert ("ms cpp" in header) == (select_backend("cpu", head_dim=64).attention == "cpp")
    bench.main(["--paths", "sdpa", "--batches", "2", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "ms sdpa" in out and "ms cpp" not in out and "decode b=2" in out
    with pytest.raises(SystemExit, match="unknown attention"):
        bench.main(["--paths", "torch"])
