"""Beam search on shared blocks, driving the engine's step API through a sampling hook.

Each live beam is a Sequence of one request. A step extends every beam by its top ``2 * width``
tokens, then keeps the ``width`` best continuations by cumulative log-probability; a
continuation that ends in EOS becomes a finished hypothesis instead (vLLM's rule). Survivors are
forks of their parent: they share its blocks by reference, and the partly filled last block is
copied on write when each writes its next token. Beams that fall out release their blocks at
once. The beams of one request may be scheduled in different steps (a tight token budget,
preemption), so the hook keeps each beam's logprobs until every live beam has reported.

Hypotheses are ranked by ``cum_logprob / generated_len ** length_penalty``, where the length
counts generated tokens without a final EOS.

``prompt_logprobs`` works as for sampling (prompt_logprobs.py): the beams' shared prefill
collects them, and they ride once on the request's first delta, which for a beam search is the
best beam's (all beams come out together at the end).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from pagedq.errors import InvalidRequestError
from pagedq.params import SamplingParams
from pagedq.worker.engine.outputs import BeamSearchOutput, CompletionOutput, StepOutput
from pagedq.worker.engine.sequence import Request, SeqStatus, Sequence
from pagedq.worker.engine.step_api import StepAPI


@dataclass
class BeamParams:
    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    ignore_eos: bool = False
    prompt_logprobs: int | None = None  # top-k per prompt position, as SamplingParams'

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise InvalidRequestError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.length_penalty, (int, float)) or self.length_penalty != self.length_penalty:
            raise InvalidRequestError(f"length_penalty must be a number, got {self.length_penalty!r}")


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens only
    cum_logprob: float
    ends_with_eos: bool = False

    def score(self, length_penalty: float) -> float:
        length = max(1, len(self.token_ids) - (1 if self.ends_with_eos else 0))
        return self.cum_logprob / (length**length_penalty)


@dataclass
class Candidate:
    parent: int  # index into the live beams
    token: int
    cum_logprob: float


def select(logprobs: torch.Tensor, cum: list[float], width: int, eos: frozenset[int],
           ignore_eos: bool) -> tuple[list[Candidate], list[Candidate]]:
    """From [beams, vocab] logprobs: (the ``width`` best live continuations, EOS-finished ones).

    Ties are broken by (beam order, token id) so the result is deterministic.
    """
    k = min(2 * width, logprobs.shape[1])
    vals, ids = logprobs.topk(k, dim=-1)
    vals = vals + torch.tensor(cum, dtype=vals.dtype)[:, None]
    cands = [Candidate(b, int(t), float(v))
             for b, (row_v, row_t) in enumerate(zip(vals.tolist(), ids.tolist(), strict=True))
             for v, t in zip(row_v, row_t, strict=True)]
    finished = [c for c in cands if c.token in eos and not ignore_eos]
    live = [c for c in cands if not (c.token in eos and not ignore_eos)]
    live.sort(key=lambda c: (-c.cum_logprob, c.parent, c.token))
    return live[:width], finished


class BeamSearch:
    """The sampling hook of one beam request (``Request.hook``): picks, forks and drops beams."""

    def __init__(self, engine: StepAPI, params: BeamParams) -> None:
        self.engine = engine
        self.params = params
        self.completed: list[Hypothesis] = []
        self.ready: dict[int, torch.Tensor] = {}  # seq_id -> logprobs row of this position

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        """Keep these beams' logprobs; once every live beam has its row, advance the beams."""
        logprobs = torch.log_softmax(logits, dim=-1)
        for row, seq in enumerate(seqs):
            self.ready[seq.seq_id] = logprobs[row]
        req = seqs[0].request
        live = [s for s in req.seqs if not s.is_finished]
        if all(s.seq_id in self.ready for s in live):
            return self._advance(req, live)
        return []

    def ranked(self) -> list[Hypothesis]:
        lp = self.params.length_penalty
        return sorted(self.completed, key=lambda h: h.score(lp), reverse=True)[: self.params.beam_width]

    def completions(self) -> list[CompletionOutput]:
        """The best ``beam_width`` hypotheses so far, best first."""
        tok = self.engine.tokenizer
        decode = tok.decode if tok is not None else (lambda ids, **_: "")
        return [CompletionOutput(rank, h.token_ids, decode(h.token_ids, skip_special_tokens=True),
                                 "stop" if h.ends_with_eos else "length", h.cum_logprob)
                for rank, h in enumerate(self.ranked())]

    def _advance(self, req: Request, live: list[Sequence]) -> list[StepOutput]:
        p = self.params
        rows = torch.stack([self.ready.pop(s.seq_id) for s in live])
        chosen, ended = select(rows, [s.cum_logprob for s in live], p.beam_width,
                               req.eos_token_ids, p.ignore_eos)
        for c in ended:
            self.completed.append(
                Hypothesis(live[c.parent].output_token_ids + [c.token], c.cum_logprob, True))
        used: set[int] = set()
        next_index = max(s.index for s in req.seqs) + 1
        survivors: list[tuple[Sequence, int, float]] = []
        for c in chosen:  # fork before any token is appended: children copy the parent's state
            seq = live[c.parent]
            if c.parent in used:
                seq = self.engine.fork(seq, next_index)
                next_index += 1
            used.add(c.parent)
            survivors.append((seq, c.token, c.cum_logprob))
        for i, seq in enumerate(live):
            if i not in used:
                self._drop(seq)
        self.engine.num_generated_tokens += len(survivors)
        for seq, token, cum in survivors:
            seq.token_ids.append(token)
            seq.cum_logprob = cum
        done = not survivors or survivors[0][0].num_generated >= p.max_tokens or any(
            s.num_tokens >= self.engine.max_model_len for s, _, _ in survivors)
        if not done:
            return []
        for seq, _, _ in survivors:
            self.completed.append(Hypothesis(seq.output_token_ids, seq.cum_logprob))
            self._drop(seq)
        return self._final_outputs(req)

    def _drop(self, seq: Sequence) -> None:
        """A beam leaves the search: its hypothesis, if any, is in ``completed`` already."""
        seq.status, seq.finish_reason = SeqStatus.FINISHED, "length"
        seq.request.seqs.remove(seq)
        self.engine.finish(seq)

    def _final_outputs(self, req: Request) -> list[StepOutput]:
        outs = []
        for rank, c in enumerate(self.completions()):
            usage = {"prompt_tokens": len(req.prompt_token_ids), "completion_tokens": len(c.token_ids)}
            outs.append(StepOutput(req.request_id, rank, c.token_ids, c.text, len(c.token_ids),
                                   True, c.finish_reason, None, usage))
        if outs and req.prompt_logprobs is not None:
            outs[0].prompt_logprobs = req.prompt_logprobs.take()
        return outs


def add_beam_request(engine: StepAPI, request_id: str, prompt: str | list[int],
                     beam: BeamParams, *, priority: int = 0,
                     deadline: float | None = None) -> Request:
    """Queue a beam search on ``engine``; its beams come out together when it finishes."""
    params = SamplingParams(temperature=0.0, max_tokens=beam.max_tokens, ignore_eos=True,
                            prompt_logprobs=beam.prompt_logprobs)
    return engine.add_request(request_id, prompt, params, priority=priority, deadline=deadline,
                              hook=BeamSearch(engine, beam))


def beam_search(engine: StepAPI, prompts: Seq[str] | Seq[list[int]], beam: BeamParams
                ) -> list[BeamSearchOutput]:
    """Run a beam search per prompt to the end; each result's ``beams`` are best first."""
    reqs = engine.run_to_completion("beam", [
        lambda rid, prompt=prompt: add_beam_request(engine, rid, prompt, beam)
        for prompt in prompts])
    return [BeamSearchOutput(r.request_id, r.prompt, r.prompt_token_ids,
                             r.hook.completions() if r.hook else [],
                             r.output().prompt_logprobs) for r in reqs]
