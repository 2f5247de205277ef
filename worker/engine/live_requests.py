"""The engine's live requests, and every way one ends.

A request ends when all its sequences finish (stop, length), or all at once: aborted by its
caller, past its deadline, or rejected after ``add_request`` accepted it (a grammar that did
not compile, a token its constraint refuses). Ending frees the sequences' blocks through the
scheduler at once. Deltas due before the next step (a request already finished when it was
added, a deadline) wait in ``pending``; rejections wait in ``rejected`` until the caller takes
them, because the step API returns deltas, not errors.
"""

from __future__ import annotations

import time

from pagedq.worker.engine.output_processor import OutputProcessor
from pagedq.worker.engine.outputs import StepOutput
from pagedq.worker.engine.scheduler import Scheduler
from pagedq.worker.engine.sequence import Request, SeqStatus, Sequence


class LiveRequests:
    """Requests by id until they end; ends them and frees their sequences' blocks."""

    def __init__(self, scheduler: Scheduler, outputs: OutputProcessor) -> None:
        self.scheduler = scheduler
        self.outputs = outputs
        self.by_id: dict[str, Request] = {}
        self.pending: list[StepOutput] = []  # deltas produced outside a step
        self.rejected: list[tuple[str, Exception]] = []  # (request id, why), see take_rejected

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_id

    def __len__(self) -> int:
        return len(self.by_id)

    def add(self, req: Request) -> None:
        if not req.finished:
            self.by_id[req.request_id] = req

    def take_pending(self) -> list[StepOutput]:
        pending, self.pending = self.pending, []
        return pending

    def take_rejected(self, ids: set[str] | None = None) -> list[tuple[str, Exception]]:
        """The rejections (of ``ids`` only, when given); each is reported once."""
        taken = [(rid, exc) for rid, exc in self.rejected if ids is None or rid in ids]
        self.rejected = [(rid, exc) for rid, exc in self.rejected
                         if ids is not None and rid not in ids]
        return taken

    def finish(self, seq: Sequence, reason: str | None = None) -> None:
        """Free a sequence's blocks, ending it with ``reason`` if it is still running; the
        request retires once all its sequences are finished."""
        if reason is not None:
            seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self.scheduler.remove(seq)
        if seq.request.finished:
            self.by_id.pop(seq.request.request_id, None)

    def end(self, req: Request, reason: str, outputs: list[StepOutput] | None = None) -> None:
        """End every running sequence of ``req`` with ``reason``; their final deltas go to
        ``outputs`` when given. Samples not forked yet are ended with it."""
        req.forked = True
        for seq in req.seqs:
            if not seq.is_finished:
                self.finish(seq, reason)
                if outputs is not None:
                    outputs.append(self.outputs.delta(seq))
        self.by_id.pop(req.request_id, None)

    def abort(self, request_id: str) -> bool:
        """Stop a request now; no further outputs are produced for it."""
        req = self.by_id.get(request_id)
        if req is None:
            return False
        self.end(req, "abort")
        return True

    def reject(self, req: Request, exc: Exception) -> None:
        """End a request that can not go on; ``take_rejected`` reports it."""
        if self.by_id.get(req.request_id) is not req:
            return
        self.end(req, "abort")
        self.rejected.append((req.request_id, exc))

    def expire(self, outputs: list[StepOutput]) -> None:
        """End the requests whose deadline has passed, with a final ``deadline`` delta each."""
        now = time.time()
        for req in [r for r in self.by_id.values() if r.deadline and r.deadline <= now]:
            self.end(req, "deadline", outputs)
