"""Shared fixtures: tiny seeded HF models (tests/tiny_models.py) and a real Redis (tests/redis_server.py).

Subprocesses the tests start (workers, kernel checks) import pagedq from this checkout, the
tree under test, whatever copy of pagedq is installed in the environment.
"""

import os
from pathlib import Path

import pytest

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
