"""The scheduler: vLLM V1's rule, with no separate prefill and decode phases.

Every step hands out at most ``max_num_batched_tokens`` tokens. Each scheduled sequence gets
``num_tokens - num_computed_tokens`` of them (capped by the budget and the long-prefill
threshold): 1 for a decode, a chunk for a prompt. Running sequences go first, so a long prompt
arriving never stalls the decodes; waiting ones are admitted in priority then FCFS order while
budget, sequence slots and KV blocks last. When blocks run out the lowest-priority, most
recently admitted running sequence is preempted: its blocks are freed and it is recomputed later
(it keeps its generated tokens, so its output does not change).

A waiting sequence whose next prompt blocks a running sequence is computing right now (same
chained block hashes, not cached yet) is held back until that sequence's step commits them, and
then admitted with them as prefix hits: N requests arriving together with one long prefix
compute it once, not N times (shared_prefix.py says why this cannot deadlock or starve).

With speculative decoding a decoding sequence may get a draft (drafts.py): 1 + k tokens of the
budget instead of 1. A draft never preempts anyone: when its slots do not fit, the sequence
decodes plainly this step.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedq.worker.config import EngineConfig
from pagedq.worker.engine.kv_cache_manager import KVCacheManager, cdiv
from pagedq.worker.engine.sequence import SeqStatus, Sequence
from pagedq.worker.engine.shared_prefix import InflightBlocks

if TYPE_CHECKING:
    from pagedq.worker.engine.drafts import Drafter


@dataclass
class SchedulerOutput:
    """One step's plan: which sequences compute how many tokens, and block copies to apply."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


def _wait_key(seq: Sequence) -> tuple[int, int, int]:
    return (*seq.request.sort_key, seq.index)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager,
                 drafter: Drafter | None = None) -> None:
        self.config = config
        self.kv = kv
        self.drafter = drafter
        self.waiting: list[Sequence] = []  # sorted by _wait_key
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0
        self._admissions = 0
        # hold back waiters whose prefix a running sequence is computing (only useful, and
        # only sound, with the prefix cache: the held request must find the blocks there)
        self.share_inflight_prefixes = kv.enable_prefix_caching
        self.num_prefix_holds = 0  # waiting sequences x steps held back for a shared prefix

    # -- queue management -----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        keys = [_wait_key(s) for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, _wait_key(seq)), seq)

    def add_running(self, seq: Sequence) -> None:
        """A fork of a running sequence joins the running set directly."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def free_capacity(self, prompt_len: int) -> int:
        """Requests of ``prompt_len`` tokens that could be admitted now: free sequence slots,
        and free blocks after the waiting sequences' prompts (each newcomer needs its prompt
        and one generated token)."""
        slots = self.config.max_num_seqs - len(self.running) - len(self.waiting)
        bs = self.kv.block_size
        reserved = sum(cdiv(s.num_tokens, bs) for s in self.waiting)
        by_blocks = (self.kv.pool.num_free - reserved) // cdiv(prompt_len + 1, bs)
        return max(0, min(slots, by_blocks))

    def stats(self) -> dict[str, int]:
        return {"running": len(self.running), "waiting": len(self.waiting),
                "preemptions": self.num_preemptions, "prefix_holds": self.num_prefix_holds}

    # -- the step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.copies = self.kv.take_copies()
        return out

    def _chunk(self, remaining: int, budget: int) -> int:
        limit = self.config.long_prefill_token_threshold
        return min(remaining, budget, limit) if limit else min(remaining, budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        speculate = self.drafter is not None and self.drafter.enabled_for(len(self.running))
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this step
                continue
            num_new = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new <= 0:  # a beam waiting for its siblings' logits
                continue
            if speculate and num_new == seq.num_tokens - seq.num_computed_tokens == 1:
                if self._draft(seq, budget):
                    out.scheduled.append((seq, 1 + len(seq.draft_token_ids)))
                    budget -= 1 + len(seq.draft_token_ids)
                    continue
            while not self.kv.allocate(seq, num_new):
                victim = self._pick_victim()
                budget += self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
        return budget

    def _draft(self, seq: Sequence, budget: int) -> bool:
        """Give a decoding sequence its draft and the slots for it, if both are to be had."""
        draft = self.drafter.propose(seq, budget - 1)
        if not draft:
            return False
        # keep a block per running sequence free: the draft must not make anyone preempt
        spare = self.kv.pool.num_free - self.kv.blocks_needed(seq, 1 + len(draft))
        if spare < len(self.running) or not self.kv.allocate(seq, 1 + len(draft)):
            return False
        seq.draft_token_ids = draft
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in order while budget, slots and blocks last; one held back
        for a shared prefix keeps its place and the next one is considered."""
        bs = self.kv.block_size
        inflight = (InflightBlocks.of(self.kv, self.running)
                    if self.share_inflight_prefixes and self.waiting else None)
        held = 0  # waiting sequences skipped this step, at the head of the queue
        while (held < len(self.waiting) and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[held]
            hit = self.kv.match_prefix(seq)
            if inflight is not None and inflight.producer_for(seq, len(hit[0])) is not None:
                held += 1
                self.num_prefix_holds += 1
                continue
            hit_tokens = len(hit[0]) * bs
            remaining = seq.num_tokens - max(hit_tokens, seq.num_computed_tokens)
            num_new = self._chunk(remaining, budget)
            if num_new < remaining and not self.config.enable_chunked_prefill:
                break
            if not self.kv.allocate(seq, num_new, hit):
                break
            if self.kv.enable_prefix_caching:
                self.kv.record_prefix_query(seq.num_tokens, hit_tokens)
            if seq.request.num_cached_tokens == 0 and seq.num_preemptions == 0:
                seq.request.num_cached_tokens = hit_tokens
            self.waiting.pop(held)
            seq.status = SeqStatus.RUNNING
            seq.admitted_at = self._admissions
            self._admissions += 1
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
            if inflight is not None:
                inflight.add(seq)

    def _pick_victim(self) -> Sequence:
        """Lowest priority first, then the most recently admitted."""
        return max(self.running, key=lambda s: (-s.request.priority, s.admitted_at))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Free ``seq``'s blocks and queue it for recompute; returns budget handed back."""
        refund = 0
        for k, (s, n) in enumerate(out.scheduled):
            if s is seq:
                refund = n
                del out.scheduled[k]
                break
        self.running.remove(seq)
        self.kv.free(seq)
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)
        return refund
