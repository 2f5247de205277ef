"""The engine thread: the only thread that touches the (not thread-safe) Engine.

It drains a thread-safe inbox of adds/aborts, runs ``step()`` while there is work, and hands
each step's outputs plus a capacity/stats snapshot to the asyncio side through a callback
(``loop.call_soon_threadsafe``). So Redis I/O never waits on compute and compute never waits
on Redis: the engine keeps stepping while the previous step's tokens are being published.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedq.params import SamplingParams
from pagedq.worker.logging import get_logger

log = get_logger("pagedq.worker.engine_loop")

IDLE_WAIT_S = 0.5  # how often an idle engine thread still reports stats
STATS_EVERY_S = 0.25


@dataclass
class AddCmd:
    """Admit one job. ``engine_id`` is ``<request id>#<epoch>`` (protocol.engine_id), so a
    stale output never reaches a later owner of the same request."""

    engine_id: str
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    priority: int = 0
    resume: list[list[int]] | None = None
    deadline: float | None = None


@dataclass
class AbortCmd:
    engine_id: str


@dataclass
class Report:
    """What one engine-thread iteration hands to the asyncio side."""

    outputs: list[Any] = field(default_factory=list)  # StepOutput
    rejected: list[tuple[str, Exception]] = field(default_factory=list)
    adds_done: int = 0  # cumulative AddCmds processed (accepted or rejected)
    capacity: int = 0  # engine.free_capacity() after this iteration
    stats: dict[str, Any] | None = None
    step_error: Exception | None = None
    step_s: float = 0.0


class EngineLoop:
    """Owns the engine in a daemon thread; ``send`` is the thread-safe way in."""

    def __init__(self, engine: Any, prompt_len_hint: int = 256):
        self.engine = engine
        self.prompt_len_hint = prompt_len_hint
        self.on_report: Callable[[Report], None] = lambda report: None
        self._inbox: queue.SimpleQueue[AddCmd | AbortCmd | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._adds_done = 0
        self._thread = threading.Thread(target=self._run, name="pagedq-engine", daemon=True)

    def start(self, on_report: Callable[[Report], None]) -> None:
        """Start the thread; it calls ``on_report`` (in the thread) after each iteration."""
        self.on_report = on_report
        self._thread.start()

    def send(self, cmd: AddCmd | AbortCmd) -> None:
        self._inbox.put(cmd)

    def abort(self, engine_id: str) -> None:
        """Stop a request and free its KV blocks (a no-op for one the engine no longer has)."""
        self._inbox.put(AbortCmd(engine_id))

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    # -- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        last_stats = 0.0
        last_capacity = -1
        while not self._stop.is_set():
            busy = self.engine.has_unfinished_requests()
            cmds = self._drain(block=not busy)
            report = Report()
            for cmd in cmds:
                self._apply(cmd, report)
            t0 = time.perf_counter()
            if self.engine.has_unfinished_requests():
                try:
                    report.outputs = self.engine.step()
                except Exception as exc:  # an engine bug must not kill the worker
                    log.exception("engine step failed")
                    report.step_error = exc
                report.rejected += self.engine.take_rejected()  # e.g. a grammar that failed
            report.step_s = time.perf_counter() - t0
            report.adds_done = self._adds_done
            report.capacity = self.engine.free_capacity(self.prompt_len_hint)
            now = time.monotonic()
            if now - last_stats >= STATS_EVERY_S or not busy:
                report.stats = self.engine.stats()
                last_stats = now
            if (report.outputs or report.rejected or cmds or report.stats is not None
                    or report.step_error or report.capacity != last_capacity):
                last_capacity = report.capacity
                self.on_report(report)

    def _drain(self, block: bool) -> list[AddCmd | AbortCmd]:
        cmds: list[AddCmd | AbortCmd] = []
        try:
            first = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
            if first is not None:
                cmds.append(first)
            while True:
                cmd = self._inbox.get_nowait()
                if cmd is not None:
                    cmds.append(cmd)
        except queue.Empty:
            pass
        return cmds

    def _apply(self, cmd: AddCmd | AbortCmd, report: Report) -> None:
        if isinstance(cmd, AbortCmd):
            self.engine.abort_request(cmd.engine_id)
            return
        self._adds_done += 1
        try:
            prompt, ids = cmd.prompt, cmd.prompt_token_ids
            if cmd.messages is not None:
                prompt, ids = None, self.engine.apply_chat_template(cmd.messages)
            self.engine.add_request(cmd.engine_id, prompt, cmd.params, prompt_token_ids=ids,
                                    priority=cmd.priority, resume=cmd.resume,
                                    deadline=cmd.deadline)
        except Exception as exc:  # typed engine errors, and anything a bad request provokes
            report.rejected.append((cmd.engine_id, exc))
