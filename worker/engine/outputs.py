"""What the engine hands back: whole results (offline API) and per-step deltas (the worker)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedq.logprobs import PromptLogprobs


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
    """The offline API's result for one prompt (``Request.output()`` builds it)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    # vLLM's shape: None for the first prompt token, then {token: logprob, top-k...} each
    prompt_logprobs: list[dict[int, float] | None] | None = None


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
    prompt_logprobs: PromptLogprobs | None = None  # on sample 0's first delta, when asked


@dataclass
class BeamSearchOutput:
    """Beam search result for one prompt: ``beams`` best first (``out[0]`` is the best)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    beams: list[CompletionOutput]
    # asked with BeamParams.prompt_logprobs: RequestOutput.prompt_logprobs' shape
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def __getitem__(self, i: int) -> CompletionOutput:
        return self.beams[i]

    def __len__(self) -> int:
        return len(self.beams)

    def __iter__(self):
        return iter(self.beams)
