"""Requests and their sequences: the scheduler's unit of work.

A ``Request`` is what a user asked for (a prompt, params, n samples). Each sample is a
``Sequence``: its own token list and block table. With n > 1 the request starts as one sequence
that prefills the prompt once and then forks into n sequences sharing the prompt's blocks.

The scheduling rule (vLLM V1) needs only two counters per sequence: ``num_tokens`` (tokens
known: prompt + generated) and ``num_computed_tokens`` (tokens whose KV is in the cache). Each
step moves the second towards the first; when they meet, the model's last logits yield a token.
A decoding sequence may also carry draft tokens for one step (speculative decoding): they are
computed as extra rows after its last known token and are never counted in either counter
until verification has turned them into tokens.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pagedq.params import SamplingParams
from pagedq.worker.engine.draft_worth import DepthCounts
from pagedq.worker.engine.outputs import CompletionOutput, RequestOutput, StepOutput

if TYPE_CHECKING:
    import torch

    from pagedq.worker.engine.detokenizer import IncrementalDetokenizer
    from pagedq.worker.engine.prompt_logprobs import PromptLogprobCollector


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_counter = itertools.count()


class SamplingHook(Protocol):
    """Picks one request's next tokens instead of the Sampler (beam search does).

    Each step the engine hands the hook the request's sequences that reached their last known
    token, with their logits rows ([len(seqs), vocab], float32). The hook appends tokens and
    forks or finishes sequences through the engine (``Engine.fork``, ``Engine.finish``), and
    returns the stream deltas it produced.
    """

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]: ...

    def completions(self) -> list[CompletionOutput]:
        """The request's results so far, as the offline API reports them."""
        ...


@dataclass(eq=False)
class Request:
    """One user request; owns its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival: int = 0  # add_request order: FCFS among equal priorities (a counter, not a clock)
    deadline: float | None = None  # unix time
    eos_token_ids: frozenset[int] = frozenset()
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # n > 1: whether the first sequence has forked into n
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    hook: SamplingHook | None = None  # picks this request's tokens instead of the Sampler
    # params.prompt_logprobs: filled by the model runner during prefill (prompt_logprobs.py)
    prompt_logprobs: PromptLogprobCollector | None = None

    @property
    def finished(self) -> bool:
        return all(s.status is SeqStatus.FINISHED for s in self.seqs) and (
            self.forked or self.params.n == 1
        )

    @property
    def sort_key(self) -> tuple[int, int]:
        """Waiting-queue order: higher priority first, then first come first served."""
        return (-self.priority, self.arrival)

    def output(self) -> RequestOutput:
        """Where the request stands: its samples by index (a hooked request's own results)."""
        if self.hook is not None:
            outs = self.hook.completions()
        else:
            outs = [CompletionOutput(s.index, s.output_token_ids, s.text, s.finish_reason,
                                     s.cum_logprob, s.logprobs)
                    for s in sorted(self.seqs, key=lambda s: s.index)]
        col = self.prompt_logprobs
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs,
                             finished=self.finished, num_cached_tokens=self.num_cached_tokens,
                             prompt_logprobs=col.result().as_dicts() if col and col.done
                             else None)


@dataclass(eq=False)
class Sequence:
    """One sample's tokens, KV bookkeeping and output state."""

    request: Request
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    # chained hashes of the full blocks of token_ids, computed or not (KVCacheManager.hash_chain
    # fills it lazily; it survives preemption, as the tokens do)
    token_block_hashes: list[int] = field(default_factory=list)
    # the scheduler's admission count when this sequence last entered the running set; the
    # highest (most recently admitted) is preempted first, losing the least computed work
    admitted_at: int = -1
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cum_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    detok: IncrementalDetokenizer | None = None  # set by OutputProcessor.start
    text: str = ""  # output text, trimmed at a stop string
    num_emitted_tokens: int = 0  # generated tokens already handed out in StepOutputs
    num_emitted_chars: int = 0  # characters of ``text`` already handed out
    num_resumed_tokens: int = 0  # generated tokens inherited from a previous owner of the job
    num_preemptions: int = 0
    # speculative decoding: this step's draft (verified as extra query rows, never part of
    # token_ids) and the draft length this sequence's recent acceptance earned (0: the config's)
    draft_token_ids: list[int] = field(default_factory=list)
    draft_forced: int = 0  # how many of draft_token_ids its grammar forced (draft_worth.py)
    draft_depths: DepthCounts = field(default_factory=DepthCounts)  # its lookups' acceptance
    spec_len: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def fork(self, index: int) -> Sequence:
        """A sibling sharing everything computed so far (the caller shares the blocks)."""
        return Sequence(
            request=self.request,
            index=index,
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            block_table=list(self.block_table),
            block_hashes=list(self.block_hashes),
            admitted_at=self.admitted_at,
            cum_logprob=self.cum_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
        )
