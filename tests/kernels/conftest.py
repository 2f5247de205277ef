"""The C++ CPU ops for the tests that call them directly (skipped, saying why, where they cannot run)."""

from __future__ import annotations

import pytest

from pagedq.kernels.backend import process_selector
from pagedq.kernels.cpu_ops import CpuOps, unavailable_reason


@pytest.fixture(scope="session")
def cpu_ops() -> CpuOps:
    selector = process_selector()
    ops = selector.library()
    if ops is None:
        why = selector.cpu.missing_for_kernels() or unavailable_reason()
        pytest.skip(f"the C++ CPU ops cannot run on this machine: {why}")
    return ops
