"""A request's result: each sample's tokens, text and finish reason, and the usage.

Plain data, importing nothing of the SDK, so the typed errors can carry a partial result
(pagedq.client.request_errors) and the builder that folds a stream into one
(pagedq.client.result_builder) can raise them, with no import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedq.client.protocol import FINISHED
from pagedq.logprobs import PromptLogprobs


@dataclass
class CompletionResult:
    """One sample's complete output."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class Result:
    """A finished request. The top-level fields are sample 0's (the only one unless n > 1)."""

    request_id: str
    outputs: list[CompletionResult]
    usage: dict[str, int] = field(default_factory=dict)
    status: str = FINISHED  # FINISHED | ERROR | CANCELLED | "running" (partial)
    # SamplingParams.prompt_logprobs: each prompt token's logprob (pagedq.logprobs)
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else None
