"""Shared fixtures: tiny seeded HF models (tests/tiny_models.py) and a real Redis (tests/redis_server.py).

Subprocesses the tests start (workers, kernel checks) import pagedq from this checkout, the
tree under test, whatever copy of pagedq is installed in the environment.
"""

import os
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)

pytest_plugins = ["tests.tiny_models", "tests.redis_server"]
