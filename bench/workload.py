"""Seeded synthetic request traces: what every system in a benchmark run is fed.

Prompts are random token ids, not text: the cost of a forward pass depends only on how many
tokens there are, and ids drawn from the model's ordinary vocabulary (special tokens excluded)
never share prefixes by accident, so prefix caching cannot flatter a figure it was not meant to.
Every request sets ``ignore_eos`` and an exact ``max_tokens``, so pagedq and the Hugging Face
baseline produce exactly the same number of tokens for the same trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedq.params import SamplingParams


@dataclass(frozen=True)
class TokenSpace:
    """The token ids a synthetic prompt may use: ``[low, high)``, no special tokens."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(
                f"empty token space [{self.low}, {self.high}): check the model's vocab_size")

    @classmethod
    def for_model(cls, vocab_size: int, special_ids: list[int | None]) -> TokenSpace:
        """The ordinary ids between the special tokens, so no prompt contains an EOS or a BOS.

        Special tokens sit at the start of the vocabulary (SmolLM2, the tiny test models) or at
        its end (Llama 3, Qwen2): ids up to the highest special in the lower half and from the
        lowest special in the upper half are skipped.
        """
        specials = [i for i in special_ids if i is not None and 0 <= i < vocab_size]
        lower = [i for i in specials if i < vocab_size // 2]
        upper = [i for i in specials if i >= vocab_size // 2]
        return cls(low=max(lower) + 1 if lower else 0, high=min(upper) if upper else vocab_size)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return rng.integers(self.low, self.high, size=n).tolist()


@dataclass(frozen=True)
class BenchRequest:
    """One request of a trace: its prompt ids and its exact output length."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.max_tokens

    def params(self) -> SamplingParams:
        """Greedy, exactly ``max_tokens`` tokens: the same work for every system."""
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)


@dataclass(frozen=True)
class LengthDist:
    """A log-normal length distribution clipped to ``[low, high]``.

    ShareGPT's prompt and reply lengths are heavy-tailed and roughly log-normal; clipping keeps a
    quick run short and every request within ``max_model_len``.
    """

    median: float
    sigma: float
    low: int
    high: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raw = rng.lognormal(mean=np.log(self.median), sigma=self.sigma, size=n)
        return np.clip(np.rint(raw), self.low, self.high).astype(int)


# ShareGPT-like shapes (medians near the ShareGPT v3 conversations after the usual filtering),
# clipped to the target's "mixed trace": prompts 32-512 tokens, outputs 16-256 tokens.
SHAREGPT_PROMPT = LengthDist(median=160.0, sigma=0.9, low=32, high=512)
SHAREGPT_OUTPUT = LengthDist(median=96.0, sigma=0.8, low=16, high=256)


def sharegpt_like(
    num_requests: int,
    space: TokenSpace,
    *,
    seed: int = 0,
    prompt: LengthDist = SHAREGPT_PROMPT,
    output: LengthDist = SHAREGPT_OUTPUT,
    prefix: str = "req",
) -> list[BenchRequest]:
    """A seeded trace: the same seed gives the same requests on every machine."""
    rng = np.random.default_rng(seed)
    prompt_lens = prompt.sample(rng, num_requests)
    output_lens = output.sample(rng, num_requests)
    return [
        BenchRequest(f"{prefix}-{i}", space.sample(rng, int(p)), int(o))
        for i, (p, o) in enumerate(zip(prompt_lens, output_lens, strict=True))
    ]


def fixed_shape(
    num_requests: int,
    prompt_len: int,
    max_tokens: int,
    space: TokenSpace,
    *,
    seed: int = 0,
    prefix: str = "fix",
) -> list[BenchRequest]:
    """``num_requests`` requests of one shape (the llama-batched-bench style sweep)."""
    rng = np.random.default_rng(seed)
    return [
        BenchRequest(f"{prefix}-{i}", space.sample(rng, prompt_len), max_tokens)
        for i in range(num_requests)
    ]


def trace_summary(requests: list[BenchRequest]) -> dict[str, float]:
    """The numbers a reader needs to judge a trace (and the concurrency target)."""
    prompts = np.array([r.prompt_len for r in requests], dtype=float)
    outputs = np.array([r.max_tokens for r in requests], dtype=float)
    return {
        "num_requests": len(requests),
        "prompt_tokens_mean": float(prompts.mean()),
        "prompt_tokens_min": int(prompts.min()),
        "prompt_tokens_max": int(prompts.max()),
        "output_tokens_mean": float(outputs.mean()),
        "output_tokens_min": int(outputs.min()),
        "output_tokens_max": int(outputs.max()),
        "output_tokens_total": int(outputs.sum()),
        "sequence_tokens_mean": float((prompts + outputs).mean()),
    }
