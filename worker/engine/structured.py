"""Structured outputs in the engine: a grammar matcher per sequence and one bitmask per step.

Each constrained request holds a ``GrammarTicket`` until its grammar has compiled (the engine
keeps it out of the scheduler meanwhile, so nothing waits on a compile). Each sequence then has
its own matcher (n > 1 samples and beams diverge). A step fills one bitmask row per constrained
row and applies all rows in one vectorized op over the batch's logits, after penalties and
before sampling; unconstrained rows are never touched, so their tokens are exactly what they
would be alone. EOS is a grammar token: allowed only where the grammar accepts, the only token
once it is complete.

A matcher follows its sequence's output tokens by count, so every way a sequence gets tokens
it did not sample in this engine is one code path: a job resumed from another worker, a fork,
or a sequence whose tokens were taken back (rollback). Preemption with recompute keeps the
tokens, so the matcher stays as it is.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from pagedq.errors import InvalidRequestError
from pagedq.worker.engine.grammar_cache import GrammarCache, GrammarTicket
from pagedq.worker.engine.sequence import Request, Sequence


@dataclass(eq=False)
class SequenceGrammar:
    """One sequence's matcher and how many of its output tokens the matcher has consumed."""

    matcher: Any
    num_accepted: int = 0


class StructuredOutputs:
    """The engine's side of structured outputs: compile tickets, matchers and the bitmask."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], *,
                 cache_size: int = 128, compile_threads: int = 2,
                 compile_timeout_s: float = 10.0) -> None:
        self.vocab_size = vocab_size
        self._cache_args = (tokenizer, vocab_size, eos_token_ids)
        self._cache_kwargs = {"max_entries": cache_size, "num_threads": compile_threads,
                              "timeout_s": compile_timeout_s}
        self._cache: GrammarCache | None = None
        self._tickets: weakref.WeakKeyDictionary[Request, GrammarTicket] = weakref.WeakKeyDictionary()
        self._compiled: weakref.WeakKeyDictionary[Request, Any] = weakref.WeakKeyDictionary()
        self._states: weakref.WeakKeyDictionary[Sequence, SequenceGrammar] = weakref.WeakKeyDictionary()
        self._bitmask: torch.Tensor | None = None
        self.mask_seconds = 0.0  # time spent filling and applying masks (for bench and stats)
        self.mask_steps = 0

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            self._cache = GrammarCache(*self._cache_args, **self._cache_kwargs)
        return self._cache

    # -- requests -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Start compiling a constrained request's grammar (no-op for an unconstrained one)."""
        so = req.params.structured_outputs
        if so is not None:
            self._tickets[req] = self.cache.submit(so)

    def is_constrained(self, req: Request) -> bool:
        return req in self._tickets

    def ready(self, req: Request) -> bool:
        """Whether the request may be scheduled; raises InvalidParamsError for a constraint that
        failed to compile (invalid, unsupported, or past the time limit)."""
        if req in self._compiled or req not in self._tickets:
            return True
        compiled = self.cache.poll(self._tickets[req])
        if compiled is None:
            return False
        self._compiled[req] = compiled
        return True

    # -- the step -------------------------------------------------------------------------
    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Mask the constrained rows of ``logits`` [rows, vocab] in place (row i is seqs[i])."""
        rows = [i for i, s in enumerate(seqs) if s.request in self._compiled]
        if not rows:
            return
        started = time.perf_counter()
        xgr = self.cache.bitmask_backend
        bitmask = self._bitmask_rows(xgr, len(seqs))
        for i in rows:
            self._sync(seqs[i]).matcher.fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=self.vocab_size, indices=rows)
        self.mask_seconds += time.perf_counter() - started
        self.mask_steps += 1

    def advance(self, seq: Sequence) -> bool:
        """Feed ``seq``'s matcher the tokens appended since (normally the one just sampled);
        returns whether the grammar is complete (it has accepted a stop token)."""
        if seq.request not in self._compiled:
            return False
        return bool(self._sync(seq).matcher.is_terminated())

    def _sync(self, seq: Sequence) -> SequenceGrammar:
        """Bring ``seq``'s matcher to its current output: create it, roll back tokens taken
        back, replay tokens it has not seen (resumed from another worker, or forked)."""
        state = self._states.get(seq)
        if state is None:
            matcher = self.cache.bitmask_backend.GrammarMatcher(self._compiled[seq.request])
            state = self._states[seq] = SequenceGrammar(matcher)
        out = seq.output_token_ids
        if state.num_accepted > len(out):
            state.matcher.rollback(state.num_accepted - len(out))
            state.num_accepted = len(out)
        for token in out[state.num_accepted:]:
            if state.matcher.is_terminated() or not state.matcher.accept_token(token):
                raise InvalidRequestError(
                    f"request {seq.request.request_id!r}: output token {token} at position "
                    f"{state.num_accepted} does not fit its structured_outputs constraint "
                    "(resumed tokens from a different model or constraint?)")
            state.num_accepted += 1
        return state

    def _bitmask_rows(self, xgr: Any, rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = xgr.allocate_token_bitmask(max(rows, 64), self.vocab_size)
        return self._bitmask[:rows]

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
