"""The engine thread: the only thread that touches the (not thread-safe) Engine.

It drains a thread-safe inbox of adds/aborts, runs ``step()`` while there is work, and hands
each step's outputs plus a capacity/stats snapshot to the asyncio side through a callback
(``loop.call_soon_threadsafe``). So Redis I/O never waits on compute and compute never waits
on Redis: the engine keeps stepping while the previous step's tokens are being published.

One request must never fail its batch mates: when a step raises, every request is taken out of
the engine and put back one at a time (``Recovery``), each resuming after the tokens it has
handed out, so nothing is lost or repeated. A step that fails right after a request came back
is blamed on that request alone, which ends with an error; the others carry on.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedq.errors import EngineError
from pagedq.logging import get_logger
from pagedq.params import SamplingParams

log = get_logger("pagedq.worker.engine_loop")

IDLE_WAIT_S = 0.5  # how often an idle engine thread still reports stats
STATS_EVERY_S = 0.25


@dataclass
class AddCmd:
    """Admit one job. ``engine_id`` is ``<request id>#<epoch>`` (protocol.engine_id), so a
    stale output never reaches a later owner of the same request. The prompt arrives as token
    ids (tokenized off this thread, intake.py); ``prompt`` keeps its text, if any."""

    engine_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    prompt: str | None = None
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


class Recovery:
    """After a failed step: the requests taken out of the engine, and which one is on trial.

    Requests come back one at a time; the last one back is on trial until it produced a token
    (or ended). A step failing meanwhile is its fault.
    """

    def __init__(self) -> None:
        self.held: deque[AddCmd] = deque()
        self.on_trial: str | None = None

    @property
    def active(self) -> bool:
        return bool(self.held) or self.on_trial is not None


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
        # engine id -> sample -> the tokens handed out in reports: what a request resumes
        # after when a failed step takes it out of the engine
        self._emitted: dict[str, dict[int, list[int]]] = {}
        self.recovery = Recovery()

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
            busy = self.engine.has_unfinished_requests() or self.recovery.active
            cmds = self._drain(block=not busy)
            report = Report()
            for cmd in cmds:
                self._apply(cmd, report)
            self._bring_back(report)
            t0 = time.perf_counter()
            if self.engine.has_unfinished_requests():
                self._step(report)
                report.rejected += self.engine.take_rejected()  # e.g. a grammar that failed
            report.step_s = time.perf_counter() - t0
            report.adds_done = self._adds_done
            report.capacity = (self.engine.free_capacity(self.prompt_len_hint)
                               - len(self.recovery.held))
            now = time.monotonic()
            if now - last_stats >= STATS_EVERY_S or not busy:
                report.stats = self.engine.stats()
                last_stats = now
            if (report.outputs or report.rejected or cmds or report.stats is not None
                    or report.step_error or report.capacity != last_capacity):
                last_capacity = report.capacity
                self.on_report(report)

    def _step(self, report: Report) -> None:
        try:
            report.outputs = self.engine.step()
        except Exception as exc:  # one request's failure must not fail its batch mates
            log.exception("engine step failed; retrying its requests one at a time")
            report.step_error = exc
            self._take_out(exc, report)
            return
        trial = self.recovery.on_trial
        for out in report.outputs:
            self._emitted.setdefault(out.request_id, {}).setdefault(out.index, []).extend(
                out.new_token_ids)
            if out.request_id == trial:
                self.recovery.on_trial = None
        if trial is not None and trial not in self.engine.requests:
            self.recovery.on_trial = None
        for rid in [r for r in self._emitted if r not in self.engine.requests]:
            del self._emitted[rid]

    def _take_out(self, exc: Exception, report: Report) -> None:
        """Take every request out of the engine after a failed step; the one on trial (or
        the only one) is to blame and ends with an error, the others come back later."""
        rids = list(self.engine.requests)
        blamed = self.recovery.on_trial if self.recovery.on_trial in rids else (
            rids[0] if len(rids) == 1 else None)
        back = []
        for rid in rids:
            cmd = self._readmission(rid)
            self.engine.abort_request(rid)
            if rid == blamed:
                report.rejected.append((rid, EngineError(
                    f"the engine failed on this request: {exc!r}; other requests carried on")))
                self._emitted.pop(rid, None)
            else:
                back.append(cmd)
        self.recovery.held.extendleft(reversed(back))
        self.recovery.on_trial = None

    def _readmission(self, rid: str) -> AddCmd:
        """The request as it stands: its prompt, and each sample's tokens handed out so far."""
        req = self.engine.requests[rid]
        emitted = self._emitted.get(rid) or {}
        resume = None
        if emitted and (req.forked or req.params.n == 1):
            resume = [list(emitted.get(i, [])) for i in range(req.params.n)]
        return AddCmd(rid, req.params, list(req.prompt_token_ids), req.prompt, req.priority,
                      resume, req.deadline)

    def _bring_back(self, report: Report) -> None:
        """Put the next held request back into the engine once none is on trial."""
        rec = self.recovery
        while rec.held and rec.on_trial is None:
            cmd = rec.held.popleft()
            if self._add(cmd, report):
                rec.on_trial = cmd.engine_id

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
            self._emitted.pop(cmd.engine_id, None)
            held = self.recovery.held
            for c in [c for c in held if c.engine_id == cmd.engine_id]:
                held.remove(c)
            return
        self._adds_done += 1
        if self.recovery.active:  # new requests wait behind those on their way back
            self.recovery.held.append(cmd)
        else:
            self._add(cmd, report)

    def _add(self, cmd: AddCmd, report: Report) -> bool:
        try:
            self.engine.add_request(cmd.engine_id, cmd.prompt, cmd.params,
                                    prompt_token_ids=cmd.prompt_token_ids,
                                    priority=cmd.priority, resume=cmd.resume,
                                    deadline=cmd.deadline)
        except Exception as exc:  # typed engine errors, and anything a bad request provokes
            report.rejected.append((cmd.engine_id, exc))
            return False
        # tokens a request resumes after were handed out already (by whoever ran it before)
        self._emitted[cmd.engine_id] = {i: list(t) for i, t in enumerate(cmd.resume or [])}
        return True
