"""Beam search on shared blocks.

Each live beam is a Sequence. A step extends every beam by its top ``2 * width`` tokens, then
keeps the ``width`` best continuations by cumulative log-probability; a continuation that ends
in EOS becomes a finished hypothesis instead (vLLM's rule). Survivors are forks of their parent:
they share its blocks by reference, and the partly filled last block is copied on write when
each writes its next token. Beams that fall out release their blocks at once.

Hypotheses are ranked by ``cum_logprob / generated_len ** length_penalty``, where the length
counts generated tokens without a final EOS.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedq.errors import InvalidRequestError


@dataclass
class BeamParams:
    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    ignore_eos: bool = False

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
class BeamState:
    """Per-request beam bookkeeping kept on ``Request.beam``."""

    params: BeamParams
    completed: list[Hypothesis] = field(default_factory=list)
    ready: dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> logprobs row

    def ranked(self) -> list[Hypothesis]:
        lp = self.params.length_penalty
        return sorted(self.completed, key=lambda h: h.score(lp), reverse=True)[: self.params.beam_width]


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
