"""What the engine hands back: whole results (offline API) and per-step deltas (the worker)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedq.worker.engine.sequence import Request


@dataclass
class CompletionOutput:
    """One sample (of n) of a finished or running request."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    cum_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None  # per token: top-k ids -> logprob


@dataclass
class RequestOutput:
    """The offline API's result for one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0

    @classmethod
    def from_request(cls, req: Request) -> RequestOutput:
        """Where the request stands: its samples by index (a hooked request's own results)."""
        if req.hook is not None:
            outs = req.hook.completions()
        else:
            outs = [CompletionOutput(s.index, s.output_token_ids, s.text, s.finish_reason,
                                     s.cum_logprob, s.logprobs)
                    for s in sorted(req.seqs, key=lambda s: s.index)]
        return cls(req.request_id, req.prompt, req.prompt_token_ids, outs,
                   finished=req.finished, num_cached_tokens=req.num_cached_tokens)


@dataclass
class StepOutput:
    """What one engine step produced for one sample of one request (a stream delta).

    ``num_generated`` is the sample's total generated-token count after these tokens, so a
    reader can place the delta: its first token sits at ``num_generated - len(new_token_ids)``.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    num_generated: int
    finished: bool = False
    finish_reason: str | None = None
    new_logprobs: list[dict[int, float]] | None = None
    usage: dict[str, int] = field(default_factory=dict)  # on the finishing delta


@dataclass
class BeamSearchOutput:
    """Beam search result for one prompt: ``beams`` best first (``out[0]`` is the best)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    beams: list[CompletionOutput]

    def __getitem__(self, i: int) -> CompletionOutput:
        return self.beams[i]

    def __len__(self) -> int:
        return len(self.beams)

    def __iter__(self):
        return iter(self.beams)
