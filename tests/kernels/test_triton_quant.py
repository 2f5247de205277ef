"""Runs tests/kernels/test_triton_quant_cases.py in Triton's CPU interpreter, in a subprocess
(``TRITON_INTERPRET=1`` must be set before triton is first imported; see
test_triton_interpreter.py). On a CUDA machine the cases run natively instead."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.subprocess_pytest import run_pytest

CASES = Path(__file__).with_name("test_triton_quant_cases.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the cases run natively")
def test_weight_only_gemm_in_interpreter():
    pytest.importorskip("triton")
    counts = run_pytest([str(CASES)], {"TRITON_INTERPRET": "1"}, timeout=900)
    assert not counts.get("skipped"), counts
