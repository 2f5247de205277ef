"""Runs tests/kernels/test_triton_quant_cases.py in Triton's CPU interpreter, in a subprocess
(``TRITON_INTERPRET=1`` must be set before triton is first imported; see
test_triton_interpreter.py). On a CUDA machine the cases run natively instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CASES = Path(__file__).with_name("test_triton_quant_cases.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the cases run natively")
def test_weight_only_gemm_in_interpreter():
    pytest.importorskip("triton")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
        env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=900,
        cwd=CASES.parents[2],
    )
    summary = result.stdout.strip().splitlines()[-1:] or [result.stderr[-2000:]]
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert "passed" in summary[0] and "skipped" not in summary[0], summary[0]
