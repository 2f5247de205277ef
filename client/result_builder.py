"""A request's result, folded from its output stream's events, with every check a reader owes
the protocol: no event missing (seq), no token missing or repeated (positions).

Redis can lose its last writes (a SIGKILL with ``appendfsync everysec``, a failover before the
replica caught up); the worker then writes those events again, under the seq numbers the
lost ones had. A reader that saw them first sees the seq go back: the builder accepts such a
rewind when the rewritten tokens equal the ones it already has (a worker resumes every job
exactly), hands out only what is new, and raises StreamGapError otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedq.client.protocol import CANCELLED, E_DEAD_LETTER, ERROR, TOKENS, Event
from pagedq.client.request_errors import (
    DeadLetteredError,
    RequestCancelledError,
    RequestFailedError,
    ResultTimeoutError,
    StreamGapError,
)
from pagedq.client.result import CompletionResult, Result


@dataclass
class SampleState:
    """One sample as read so far: its output, where its first token sits, and the text length
    at each event boundary (where a rewritten stream starts again)."""

    result: CompletionResult
    first: int | None = None  # position of result.token_ids[0]; None until the first event
    text_at: dict[int, int] = field(default_factory=dict)  # position -> len(result.text)

    @property
    def position(self) -> int | None:
        return None if self.first is None else self.first + len(self.result.token_ids)


class ResultBuilder:
    """Folds a request's events, in order, into a Result; detects gaps and duplicates.

    ``expect_seq`` is the next seq; None when reading started mid-stream (unknown).
    """

    def __init__(self, request_id: str, expect_seq: int | None = 1):
        self.request_id = request_id
        self.expect_seq = expect_seq
        self.from_start = expect_seq == 1
        self.states: dict[int, SampleState] = {}
        self.terminal: Event | None = None
        self.prompt_logprobs = None  # from sample 0's first event (pagedq.logprobs)

    @property
    def samples(self) -> dict[int, CompletionResult]:
        return {i: st.result for i, st in self.states.items()}

    def feed(self, ev: Event) -> bool:
        """Fold ``ev`` in; False when it holds nothing new (a rewritten event already read),
        else True, with ``ev`` trimmed to what is new."""
        rewind = self.expect_seq is not None and ev.seq < self.expect_seq
        if self.expect_seq is not None and ev.seq > self.expect_seq:
            raise StreamGapError(
                f"request {self.request_id}: expected event seq {self.expect_seq}, got "
                f"{ev.seq}; events were lost (expired keys?). Resubmit the request or raise the "
                "worker --ttl")
        self.expect_seq = ev.seq + 1
        if ev.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = ev.prompt_logprobs
        if ev.type == TOKENS:
            return self._tokens(ev)
        if rewind and self.terminal is not None:
            return False
        if ev.terminal:
            self.terminal = ev
            for i, reason in enumerate(ev.finish_reasons or []):
                sample = self._state(i).result
                if sample.finish_reason is None:
                    sample.finish_reason = reason
        return True

    def _state(self, index: int) -> SampleState:
        if index not in self.states:
            self.states[index] = SampleState(CompletionResult(index))
            if self.from_start:
                self.states[index].first = 0
                self.states[index].text_at[0] = 0
        return self.states[index]

    def _tokens(self, ev: Event) -> bool:
        st = self._state(ev.index)
        sample = st.result
        start = ev.position - len(ev.token_ids)
        if st.first is None:  # reading began mid-stream: this event sets the origin
            st.first, st.text_at[start] = start, 0
        known = st.position
        if start > known:
            raise StreamGapError(f"request {self.request_id} sample {ev.index}: tokens at "
                                 f"position {start} follow position {known}; the stream is "
                                 "not contiguous")
        if start < known and not self._trim_rewritten(st, ev, start, known):
            return False
        sample.token_ids.extend(ev.token_ids)
        sample.text += ev.text
        st.text_at[ev.position] = len(sample.text)
        if ev.logprobs:
            sample.logprobs = (sample.logprobs or []) + list(ev.logprobs)
        if ev.finish_reason is not None:
            sample.finish_reason = ev.finish_reason
        return True

    def _trim_rewritten(self, st: SampleState, ev: Event, start: int, known: int) -> bool:
        """``ev`` starts before what was read (Redis lost writes and the worker wrote them
        again): check it against what was read and cut it down to what follows; False when
        nothing follows."""
        sample = st.result
        overlap = min(known, ev.position) - start
        i, base = start - (st.first or 0), st.text_at.get(start)
        if i < 0 or base is None or sample.token_ids[i:i + overlap] != ev.token_ids[:overlap]:
            raise self._diverged(ev, start)
        read_text = sample.text[base:]
        if ev.position <= known:  # all of it was read already
            if not read_text.startswith(ev.text):
                raise self._diverged(ev, start)
            st.text_at.setdefault(ev.position, base + len(ev.text))
            return False
        if not ev.text.startswith(read_text):
            raise self._diverged(ev, start)
        ev.token_ids = ev.token_ids[overlap:]
        ev.text = ev.text[len(read_text):]
        if ev.logprobs:
            ev.logprobs = ev.logprobs[overlap:]
        return True

    def _diverged(self, ev: Event, start: int) -> StreamGapError:
        return StreamGapError(
            f"request {self.request_id} sample {ev.index}: the stream was rewritten from "
            f"position {start} with other tokens than were read (Redis lost writes and the "
            "job did not resume identically); resubmit it under a new id")

    @property
    def done(self) -> bool:
        return self.terminal is not None

    def partial(self) -> Result:
        outputs = [self.states[i].result for i in sorted(self.states)] or [CompletionResult(0)]
        status = self.terminal.type if self.terminal else "running"
        usage = dict(self.terminal.usage or {}) if self.terminal else {}
        return Result(self.request_id, outputs, usage, status, self.prompt_logprobs)

    def result(self) -> Result:
        """The Result, or the typed error the terminal event stands for."""
        res = self.partial()
        term = self.terminal
        if term is None:
            raise ResultTimeoutError(f"request {self.request_id} has not finished yet")
        if term.type == ERROR:
            cls = DeadLetteredError if term.error_code == E_DEAD_LETTER else RequestFailedError
            raise cls(term.error or "unknown error", self.request_id, term.error_code or "", res)
        if term.type == CANCELLED:
            raise RequestCancelledError(f"request {self.request_id} was cancelled",
                                        self.request_id, res)
        return res
