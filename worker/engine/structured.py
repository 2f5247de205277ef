"""Structured outputs in the engine: a grammar matcher per sequence and one bitmask per step.

Each constrained request holds a ``GrammarTicket`` until its grammar has compiled (the engine
keeps it out of the scheduler meanwhile, so nothing waits on a compile). Each sequence then has
its own matcher (n > 1 samples diverge). A step fills one bitmask row per constrained
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
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from typing import Any

import torch

from pagedq.errors import InvalidRequestError, PagedQError
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
        self._compiling: list[Request] = []  # added, grammar not compiled yet
        self._bitmask: torch.Tensor | None = None
        self._draft_row: torch.Tensor | None = None
        self.mask_seconds = 0.0  # time spent filling and applying masks (for bench and stats)
        self.mask_steps = 0
        self.draft_seconds = 0.0  # time spent finding forced tokens for drafts (forced_tokens)
        self.draft_tokens = 0

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            self._cache = GrammarCache(*self._cache_args, **self._cache_kwargs)
        return self._cache

    # -- requests -------------------------------------------------------------------------
    def add(self, req: Request) -> bool:
        """Start compiling a constrained request's grammar; returns whether the request must
        wait for it (``take_compiled`` hands it back once it may be scheduled)."""
        so = req.params.structured_outputs
        if so is None:
            return False
        self._tickets[req] = self.cache.submit(so)
        if self._poll(req):
            return False
        self._compiling.append(req)
        return True

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def take_compiled(self) -> tuple[list[Request], list[tuple[Request, PagedQError]]]:
        """(requests whose grammar is ready, requests whose constraint failed to compile:
        invalid, unsupported, or past the time limit). Requests that ended meanwhile (aborted,
        past their deadline) are dropped."""
        ready: list[Request] = []
        failed: list[tuple[Request, PagedQError]] = []
        waiting: list[Request] = []
        for req in self._compiling:
            if all(s.is_finished for s in req.seqs):
                continue
            try:
                (ready if self._poll(req) else waiting).append(req)
            except PagedQError as exc:
                failed.append((req, exc))
        self._compiling = waiting
        return ready, failed

    def wait_compiling(self, timeout: float) -> None:
        """Sleep until a compile finishes or ``timeout`` passes: for an engine with nothing else
        to do, instead of spinning against the compile threads."""
        futures = [self._tickets[r].entry.future for r in self._compiling]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def _poll(self, req: Request) -> bool:
        if req in self._compiled:
            return True
        compiled = self.cache.poll(self._tickets[req])
        if compiled is None:
            return False
        self._compiled[req] = compiled
        return True

    # -- the step -------------------------------------------------------------------------
    def apply(self, logits: torch.Tensor, seqs: list[Sequence], best: list[int] | None = None
              ) -> bool:
        """Mask the constrained rows of ``logits`` [rows, vocab] in place (row i is seqs[i]);
        a row whose ``best[i]`` (its greedy pick, -1: none) the grammar accepts is left as it is
        (the Sampler says why). Returns whether any row was masked.

        Why: filling and applying one row's mask cost ~80 us on the bundled model (a 49,152-token
        vocabulary, AMD EPYC Zen 5), 2.5 times a step while speculative drafts are verified one
        position at a time, and the model's own pick is nearly always one the grammar allows."""
        rows = [i for i, s in enumerate(seqs) if s.request in self._compiled]
        if best is not None:
            rows = [i for i in rows if best[i] < 0 or not self._accepts(seqs[i], best[i])]
        if not rows:
            return False
        started = time.perf_counter()
        xgr = self.cache.bitmask_backend
        bitmask = self._bitmask_rows(xgr, len(seqs))
        for i in rows:
            self._sync(seqs[i]).matcher.fill_next_token_bitmask(bitmask, i)
        if logits.is_cuda:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                            vocab_size=self.vocab_size, indices=rows)
        else:
            apply_bitmask_cpu(logits, bitmask, rows)
        self.mask_seconds += time.perf_counter() - started
        self.mask_steps += 1
        return True

    def _accepts(self, seq: Sequence, token: int) -> bool:
        """Whether ``seq``'s grammar allows ``token`` next (the matcher is left where it was)."""
        matcher = self._sync(seq).matcher
        if matcher.is_terminated() or not matcher.accept_token(token):
            return False
        matcher.rollback(1)
        return True

    def advance(self, seq: Sequence, token: int) -> bool:
        """Feed ``seq``'s matcher the token just sampled for it (before it joins the sequence);
        returns whether the grammar is complete (it has accepted a stop token)."""
        if seq.request not in self._compiled:
            return False
        state = self._sync(seq)
        self._accept(seq, state, token)
        return bool(state.matcher.is_terminated())

    def allowed_draft(self, seq: Sequence, draft: list[int]) -> list[int]:
        """The longest prefix of a speculative draft that ``seq``'s grammar accepts after its
        current output (a forbidden token ends the draft); the matcher is left where it was."""
        if seq.request not in self._compiled:
            return draft
        try:
            matcher = self._sync(seq).matcher
        except InvalidRequestError:  # tokens its grammar refuses: sampling rejects the request
            return []
        n = 0
        for token in draft:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return draft[:n]

    def forced_tokens(self, seq: Sequence, k: int) -> list[int]:
        """Up to ``k`` tokens ``seq``'s grammar forces after its current output: a draft that
        verification keeps wherever the model tokenizes the forced text as xgrammar does.

        Each round takes xgrammar's jump-forward tokens (the forced text, longest vocabulary
        tokens first, its last token left out when a longer token could extend it); when
        there are none, one bitmask shows whether exactly one token is allowed (a ``}`` that
        a longer token would extend only outside the grammar, the stop token of a complete
        output). The first position with a choice ends the draft. The matcher is advanced
        over the draft and rolled back, so it is left where it was."""
        if k <= 0 or seq.request not in self._compiled:
            return []
        started = time.perf_counter()
        try:
            matcher = self._sync(seq).matcher
        except InvalidRequestError:  # tokens its grammar refuses: sampling rejects the request
            return []
        draft: list[int] = []
        try:
            while len(draft) < k and not matcher.is_terminated():
                step = matcher.find_jump_forward_tokens()[: k - len(draft)] or self._only(matcher)
                taken = 0
                for token in step:
                    if not matcher.accept_token(token):
                        break
                    taken += 1
                draft += step[:taken]
                if taken < len(step) or not step:
                    break
        finally:
            if draft:
                matcher.rollback(len(draft))
            self.draft_seconds += time.perf_counter() - started
            self.draft_tokens += len(draft)
        return draft

    def _only(self, matcher: Any) -> list[int]:
        """[the one token the grammar allows next], or [] when it allows several."""
        if self._draft_row is None:  # its own row: the step's bitmask may be in use
            self._draft_row = self.cache.bitmask_backend.allocate_token_bitmask(1, self.vocab_size)
        row = self._draft_row
        matcher.fill_next_token_bitmask(row, 0)
        words = torch.nonzero(row[0])
        if words.numel() != 1:
            return []
        index = int(words[0, 0])
        bits = int(row[0, index]) & 0xFFFFFFFF
        if bits & (bits - 1):
            return []
        token = 32 * index + bits.bit_length() - 1
        return [token] if token < self.vocab_size else []

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
            self._accept(seq, state, token)
        return state

    @staticmethod
    def _accept(seq: Sequence, state: SequenceGrammar, token: int) -> None:
        if state.matcher.is_terminated() or not state.matcher.accept_token(token):
            raise InvalidRequestError(
                f"request {seq.request.request_id!r}: output token {token} at position "
                f"{state.num_accepted} does not fit its structured_outputs constraint "
                "(resumed tokens from a different model or constraint?)")
        state.num_accepted += 1

    def _bitmask_rows(self, xgr: Any, rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = xgr.allocate_token_bitmask(max(rows, 64), self.vocab_size)
        return self._bitmask[:rows]

    def stats(self) -> dict[str, Any]:
        return {"grammar_compiling": len(self._compiling),
                "grammar_mask_s": round(self.mask_seconds, 6), "grammar_mask_steps": self.mask_steps,
                "grammar_draft_s": round(self.draft_seconds, 6),
                "grammar_draft_tokens": self.draft_tokens}

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()


_BYTE_MASKS: dict[torch.dtype, torch.Tensor] = {}


def apply_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set ``logits[r, t]`` to -inf where bit t of ``bitmask[r]`` is clear, for r in ``rows``.

    Each byte of the mask selects a row of a 256 x 8 table of 0 / -inf (one ``embedding``
    lookup), and the result is added to the rows in one ``index_add_``: a few passes over the
    logits, parallel across torch's threads, several times faster than xgrammar's
    single-threaded CPU kernel on a full batch. The mask's int32 words are little-endian, so
    byte k of word w holds tokens 32w + 8k ... 32w + 8k + 7.
    """
    table = _BYTE_MASKS.get(logits.dtype)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = _BYTE_MASKS[logits.dtype] = torch.zeros(256, 8, dtype=logits.dtype).masked_fill_(
            bits == 0, float("-inf"))
    every_row = len(rows) == logits.shape[0]  # a fully constrained batch: no gather/scatter
    index = None if every_row else torch.tensor(rows)
    words = bitmask[: len(rows)] if every_row else bitmask[index]
    penalty = torch.nn.functional.embedding(words.contiguous().view(torch.uint8).int(), table)
    penalty = penalty.view(len(rows), -1)[:, :logits.shape[1]]
    if every_row:
        logits.add_(penalty)
    else:
        logits.index_add_(0, index, penalty)
