"""An exclusive lock on a file across processes, for caches that several processes fill.

Ground floor (nothing above it imported): the model cache (pagedq.worker.models.model_cache)
and the kernels' measured crossovers (pagedq.kernels.crossover) both take it.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    """An exclusive fcntl lock across processes (not re-entrant: never nest on one path)."""
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
