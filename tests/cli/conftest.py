"""The commands configure logging for a person at a terminal (console lines, a level, live
progress); each test here puts the process's logging back as it found it."""

from __future__ import annotations

import pytest
import structlog

from pagedq import progress


@pytest.fixture(autouse=True)
def restore_logging():
    config = structlog.get_config()
    live = dict(progress._live)
    yield
    structlog.configure(**config)
    progress._live.update(live)
