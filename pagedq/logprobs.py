"""Prompt logprobs: what the engine computes for ``SamplingParams.prompt_logprobs`` and what
the wire, the SDK and the gateway carry.

vLLM's semantics: for each prompt token after the first, the log-probability of that token
given the tokens before it (the model's raw distribution, fp32 log_softmax), its rank in that
distribution (1 = the most likely), and the top-k alternatives when k > 0. The first prompt
token has no context, so its entry is None.

Held column-wise (one list per field, one entry per prompt position), so the wire form is a
map of flat lists and a 4,000-token prompt costs no per-token map headers. Ground floor: no
torch, the SDK and the gateway import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PromptLogprobs:
    """Per prompt position i: ``token_ids[i]``; for i >= 1 its ``logprobs[i]`` and
    ``ranks[i]``, and ``top[i]`` (token id -> logprob, best first, k entries); None at 0."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    top: list[dict[int, float] | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def as_dicts(self) -> list[dict[int, float] | None]:
        """vLLM's ``RequestOutput.prompt_logprobs`` shape: None for the first position, then
        {prompt token: logprob, top-k ids: logprob} per position (the prompt token first)."""
        out: list[dict[int, float] | None] = []
        for i, token in enumerate(self.token_ids):
            if i == 0 or self.logprobs[i] is None:
                out.append(None)
                continue
            entry = {token: float(self.logprobs[i])}
            for t, lp in (self.top[i] or {}).items():
                entry.setdefault(t, lp)
            out.append(entry)
        return out

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-able map (top maps as [[id, logprob], ...]: msgpack keys stay strings)."""
        return {"token_ids": list(self.token_ids), "logprobs": list(self.logprobs),
                "ranks": list(self.ranks),
                "top": [None if t is None else [[int(k), float(v)] for k, v in t.items()]
                        for t in self.top]}

    @classmethod
    def from_wire(cls, data: Any) -> PromptLogprobs:
        """Inverse of ``to_wire``; a malformed map raises ValueError."""
        try:
            top = [None if t is None else {int(k): float(v) for k, v in t} for t in data["top"]]
            out = cls([int(t) for t in data["token_ids"]],
                      [None if v is None else float(v) for v in data["logprobs"]],
                      [None if r is None else int(r) for r in data["ranks"]], top)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed prompt_logprobs: {exc!r}") from exc
        if not len(out.logprobs) == len(out.ranks) == len(out.top) == len(out.token_ids):
            raise ValueError("malformed prompt_logprobs: its lists differ in length")
        return out
