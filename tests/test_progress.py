"""pagedq/progress.py: a long wait says what it does when it starts and how long it took; a
short one stays silent."""

from __future__ import annotations

import threading
import time

import pytest

from pagedq.progress import waiting


class Lines:
    """A logger that keeps what it is told (the structlog call shape: message, fields)."""

    def __init__(self):
        self.lines: list[tuple[str, dict]] = []
        self.lock = threading.Lock()

    def info(self, message, **fields):
        with self.lock:
            self.lines.append((message, fields))


def test_a_long_wait_is_announced_and_timed():
    log = Lines()
    with waiting("compiling the kernels", log, delay=0.05, path="/x"):
        time.sleep(0.3)
    (start, start_fields), (end, end_fields) = log.lines
    assert start == "compiling the kernels" and start_fields == {"path": "/x"}
    assert end == "done: compiling the kernels" and end_fields["seconds"] >= 0.2


def test_a_short_wait_stays_silent():
    log = Lines()
    with waiting("loading cached kernels", log, delay=1.0):
        pass
    assert log.lines == []


def test_delay_zero_announces_at_once_and_errors_pass_through():
    log = Lines()
    with pytest.raises(ValueError, match="network down"), waiting("downloading", log, delay=0):
        time.sleep(0.05)
        raise ValueError("network down")
    assert [m for m, _ in log.lines] == ["downloading", "failed: downloading"]
