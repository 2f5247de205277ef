"""What a long wait shows: one log line when it starts, a live timer on a terminal, one when
it ends.

``waiting("compiling ...", log)`` wraps anything that may take more than a couple of seconds
(a download, a conversion, a compile, a model load). A wait that ends within ``delay`` shows
nothing, so a cached step stays silent; a longer one logs what it is doing through structlog
(a JSON line for a service, a console line for a person) and, when stderr is a terminal that
``enable_live()`` switched on, keeps a spinner with the elapsed seconds below the log until
it ends. Nothing here prints: rich draws the spinner on stderr and log lines pass above it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog

DELAY_S = 2.0
_live = {"on": False}
_drawing = threading.Lock()  # rich draws one live display at a time: a nested wait only logs
_active: list[tuple[str, float]] = []  # announced waits, innermost last: what the spinner shows


class _CurrentStderr:
    """A file that writes to whatever ``sys.stderr`` is now, so log lines go through rich's
    redirect while a spinner is live (structlog keeps the file it was given)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def enable_live(on: bool = True) -> None:
    """Show spinners on a terminal (the CLI's console mode); route console logs past them."""
    _live["on"] = on
    if on:
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()))


def _console() -> Any:
    if not (_live["on"] and sys.stderr.isatty()):
        return None
    from rich.console import Console  # only on a terminal: rich takes ~0.25 s to import

    return Console(stderr=True)


@contextmanager
def waiting(what: str, log: Any, *, delay: float = DELAY_S, **fields: Any) -> Iterator[None]:
    """Say ``what`` is happening if it lasts longer than ``delay`` seconds, and how long it
    took once it is done."""
    start = time.perf_counter()
    done = threading.Event()
    shown = threading.Event()

    def announce() -> None:
        if done.wait(delay):
            return
        log.info(what, **fields)
        _active.append((what, start))
        shown.set()
        console = _console()
        if console is None or not _drawing.acquire(blocking=False):
            return
        try:
            with console.status(what) as status:
                while not done.wait(0.25):
                    inner, since = _active[-1] if _active else (what, start)
                    status.update(f"{inner} ({time.perf_counter() - since:.0f} s)")
        finally:
            _drawing.release()

    watcher = threading.Thread(target=announce, name="pagedq-progress", daemon=True)
    watcher.start()
    outcome = "done"
    try:
        yield
    except BaseException:
        outcome = "failed"
        raise
    finally:
        done.set()
        watcher.join()
        if (what, start) in _active:
            _active.remove((what, start))
        if shown.is_set():
            log.info(f"{outcome}: {what}", seconds=round(time.perf_counter() - start, 1))
