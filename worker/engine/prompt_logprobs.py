"""Prompt logprobs (``SamplingParams.prompt_logprobs``): collected by the model runner from
the hidden rows of a request's prefill chunks.

The engine normally computes logits at one row per sequence (its last known token). For a
request that asks for prompt logprobs, the runner also keeps the final hidden rows of every
prompt position of each chunk it prefills; the row at position p predicts token p + 1. Those
rows go through the LM head in slices (so a long chunk never holds [chunk, vocab] logits at
once), then an fp32 log_softmax, a gather of each next prompt token's logprob, its rank and
the top-k: all on tensors, per chunk. The request's collector keeps the small per-chunk
results and turns them into one ``PromptLogprobs`` when the prompt is done.

A sequence preempted mid-prefill recomputes from the start: rows for positions already
collected are skipped, so each position is counted once. Such a request reads nothing from
the prefix cache until its prompt logprobs are complete (kv_cache_manager.match_prefix): a
cached block would skip exactly the rows it needs. vLLM does the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedq.logprobs import PromptLogprobs

LOGITS_SLICE_ROWS = 256  # rows of [rows, vocab] fp32 logits computed at once


@dataclass
class ChunkLogprobs:
    """One prefill chunk's results, for consecutive prompt positions."""

    token_logprobs: torch.Tensor  # [m] fp32: logprob of the next prompt token
    ranks: torch.Tensor  # [m] long: its rank (1 = most likely), vLLM's count of >=
    top_logprobs: torch.Tensor  # [m, k] fp32, best first
    top_ids: torch.Tensor  # [m, k] long


@dataclass
class PromptLogprobCollector:
    """A request's prompt logprobs as its prefill chunks produce them."""

    k: int
    prompt_token_ids: list[int]
    covered: int = 0  # rows collected: positions [0, covered) predict tokens [1, covered]
    chunks: list[ChunkLogprobs] = field(default_factory=list)
    emitted: bool = False  # handed out in a stream delta

    @property
    def needed(self) -> int:
        """Rows to collect: one per prompt position but the last (which predicts the output)."""
        return max(0, len(self.prompt_token_ids) - 1)

    @property
    def done(self) -> bool:
        return self.covered >= self.needed

    def rows_wanted(self, start: int, num: int) -> tuple[int, int]:
        """Of a chunk computing positions [start, start + num): the slice of its rows
        (relative to the chunk) not yet collected, as (first, end); first == end: none."""
        end = min(start + num, self.needed)
        first = max(start, self.covered)
        return (first - start, end - start) if first < end else (0, 0)

    def take(self) -> PromptLogprobs | None:
        """The result for the request's first delta: once, when ``done`` (else None). A plain
        request hands it to sample 0's first delta (output_processor.py), a beam search to
        its best beam's (beam_search.py): vLLM's "the prompt's logprobs once, first"."""
        if self.emitted or not self.done:
            return None
        self.emitted = True
        return self.result()

    def add(self, chunk: ChunkLogprobs) -> None:
        self.chunks.append(chunk)
        self.covered += len(chunk.token_logprobs)

    def result(self) -> PromptLogprobs:
        """The whole prompt's logprobs (None at position 0); call once ``done``."""
        ids = self.prompt_token_ids
        if not self.chunks:
            return PromptLogprobs(list(ids), [None] * len(ids), [None] * len(ids),
                                  [None] * len(ids))
        lps = torch.cat([c.token_logprobs for c in self.chunks]).tolist()
        ranks = torch.cat([c.ranks for c in self.chunks]).tolist()
        if self.k:
            top_ids = torch.cat([c.top_ids for c in self.chunks]).tolist()
            top_lps = torch.cat([c.top_logprobs for c in self.chunks]).tolist()
            top = [dict(zip(i, v, strict=True)) for i, v in zip(top_ids, top_lps, strict=True)]
        else:
            top = [{} for _ in lps]
        return PromptLogprobs(list(ids), [None, *lps], [None, *ranks], [None, *top])


def compute_chunk_logprobs(compute_logits, hidden: torch.Tensor, targets: torch.Tensor,
                           k: int) -> ChunkLogprobs:
    """``hidden`` [m, d] final hidden rows, ``targets`` [m] the tokens they should predict:
    each target's fp32 logprob and rank, and the top-k, computed ``LOGITS_SLICE_ROWS`` rows
    at a time through ``compute_logits`` (the model's LM head)."""
    parts: list[tuple[torch.Tensor, ...]] = []
    for lo in range(0, len(hidden), LOGITS_SLICE_ROWS):
        rows = slice(lo, lo + LOGITS_SLICE_ROWS)
        logprobs = torch.log_softmax(compute_logits(hidden[rows]).float(), dim=-1)
        chosen = logprobs.gather(1, targets[rows, None])
        ranks = (logprobs >= chosen).sum(dim=1)
        vals, ids = logprobs.topk(k, dim=1) if k else (logprobs[:, :0], ranks[:, None][:, :0])
        parts.append((chosen.squeeze(1), ranks, vals, ids))
    cols = [torch.cat(col).cpu() for col in zip(*parts, strict=True)]
    return ChunkLogprobs(cols[0], cols[1], cols[2], cols[3].long())
