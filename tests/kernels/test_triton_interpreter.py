"""Runs tests/kernels/test_triton_cases.py in Triton's CPU interpreter, in a subprocess.

Why a subprocess: ``TRITON_INTERPRET=1`` only takes effect if it is set before triton is first
imported, and it would slow down or change every other Triton user in this pytest session.
On a CUDA machine the cases run natively in this session instead, so this wrapper skips.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.subprocess_pytest import run_pytest

CASES = Path(__file__).with_name("test_triton_cases.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the cases run natively")
def test_triton_kernels_in_interpreter():
    pytest.importorskip("triton")
    counts = run_pytest([str(CASES)], {"TRITON_INTERPRET": "1"}, timeout=600)
    assert not counts.get("skipped"), counts
