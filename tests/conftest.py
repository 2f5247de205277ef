"""Shared fixtures: tiny seeded HF models (tests/tiny_models.py) and a real Redis (tests/redis_server.py).

Subprocesses the tests start (workers, kernel checks) import pagedq from this checkout, the
tree under test, whatever copy of pagedq is installed in the environment.
"""

import os
from pathlib import Path

import pytest

from pagedq.kernels.backend import process_selector
from pagedq.kernels.cpu_ops import CpuOps, unavailable_reason
from pagedq.worker.config import settings

ROOT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)

pytest_plugins = ["tests.tiny_models", "tests.redis_server"]


@pytest.fixture(autouse=True)
def fresh_settings():
    """Each test reads the environment afresh: settings() caches it once per process."""
    settings.cache_clear()
    yield
    settings.cache_clear()


@pytest.fixture(scope="session")
def cpu_ops() -> CpuOps:
    """The C++ CPU ops. Skipped, saying why, only where they cannot run (not x86-64, no AVX2, or
    PAGEDQ_CPU_KERNEL=0); on a CPU that runs them a failed build fails every test that needs
    them: a broken compile must not turn the suite green with skips."""
    selector = process_selector()
    if not selector.switches.cpu_kernels:
        pytest.skip("PAGEDQ_CPU_KERNEL=0 switches the C++ CPU ops off")
    if not selector.cpu.runs_cpp_kernels:
        pytest.skip(f"the C++ CPU ops cannot run on this machine: {selector.cpu.missing_for_kernels()}")
    ops = selector.library()
    if ops is None:
        pytest.fail(f"the C++ CPU ops failed to build on a CPU that runs them: {unavailable_reason()}")
    return ops
