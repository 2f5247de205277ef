"""Shared fixtures: tiny seeded HF models (tests/tiny_models.py) and a real Redis (tests/redis_server.py).

Subprocesses the tests start (workers, kernel checks) import pagedq from this checkout, the
tree under test, whatever copy of pagedq is installed in the environment.

The tests never write into the user's pagedq cache (~/.cache/pagedq, or $PAGEDQ_CACHE): the
session runs on a temporary one (``$PAGEDQ_CACHE`` for this process and every subprocess),
removed at the end. ``$PAGEDQ_TEST_CACHE`` names a directory to use instead and keep (a CI
cache, so the bundled model's conversions are made once). The bundled model's GGUF is read
from where the user's cache kept it, when it did, through ``$PAGEDQ_DEFAULT_GGUF`` (read only),
so a session does not fetch it again.
"""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from pagedq.kernels.backend import process_selector
from pagedq.kernels.cpu_ops import CpuOps, unavailable_reason
from pagedq.redis_url import pagedq_cache_dir
from pagedq.worker.config import settings

ROOT = str(Path(__file__).resolve().parents[1])


def _checkout_path() -> str:
    """A folder holding only a link to this checkout's ``pagedq``: on PYTHONPATH it makes the
    subprocesses import the tree under test, without also making the top-level folders
    (``client``, ``worker``, ``kernels``, ...) importable under those generic names."""
    folder = Path(tempfile.mkdtemp(prefix="pagedq-checkout-"))
    (folder / "pagedq").symlink_to(Path(ROOT) / "pagedq", target_is_directory=True)
    return str(folder)


CHECKOUT_PATH = _checkout_path()
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (CHECKOUT_PATH, os.environ.get("PYTHONPATH")) if p)


# default_model.GGUF_FILENAME, written out: importing that module imports torch (4 s), which
# an SDK-only session never needs (tests/models/test_loader.py checks the two agree).
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _session_cache() -> tuple[Path, bool]:
    """The session's pagedq cache and whether it is ours to remove at the end."""
    kept = pagedq_cache_dir() / "gguf" / BUNDLED_GGUF
    if not os.environ.get("PAGEDQ_DEFAULT_GGUF") and kept.is_file():
        os.environ["PAGEDQ_DEFAULT_GGUF"] = str(kept)
    chosen = os.environ.get("PAGEDQ_TEST_CACHE")
    if chosen:
        return Path(chosen).expanduser(), False
    return Path(tempfile.mkdtemp(prefix="pagedq-test-cache-")), True


SESSION_CACHE, _REMOVE_CACHE = _session_cache()
os.environ["PAGEDQ_CACHE"] = str(SESSION_CACHE)
# Processes started from here on (pytest-xdist's workers, inner pytest runs) share this cache,
# so the bundled model is converted once a run; only the process that made it removes it.
os.environ["PAGEDQ_TEST_CACHE"] = str(SESSION_CACHE)
settings.cache_clear()


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(CHECKOUT_PATH, ignore_errors=True)
    if _REMOVE_CACHE:
        shutil.rmtree(SESSION_CACHE, ignore_errors=True)

pytest_plugins = ["tests.tiny_models", "tests.redis_server", "tests.chaos.pki"]  # pki, tls_server


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
