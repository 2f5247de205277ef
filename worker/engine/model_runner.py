"""Turns a scheduler plan into one forward pass over the paged KV cache.

It owns the KV tensors (one [2, num_blocks, block_size, kv_heads, head_dim] slab per layer),
packs every scheduled sequence's new tokens into one flat batch, derives positions and cache
slots from the block tables, and returns the logits of the sequences whose last
known token was just computed (the ones that sample this step). A sequence with a draft
(speculative decoding) computes its draft tokens after its last known token and returns
1 + len(draft) logits rows: one per position the verification may sample. A request asking
for prompt logprobs also has the rows of its prompt positions run through the LM head
(prompt_logprobs.py), into its collector.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from pagedq.kernels import plan_attention
from pagedq.worker.engine.prompt_logprobs import PromptLogprobCollector, compute_chunk_logprobs
from pagedq.worker.engine.scheduler import SchedulerOutput
from pagedq.worker.engine.sequence import Sequence
from pagedq.worker.models.llama import AttentionContext, CausalLM


@dataclass
class StepBatch:
    """The flat inputs of one step (kept for inspection and tests)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    logits_indices: torch.Tensor
    sample_seqs: list[Sequence]
    # prompt logprobs: (collector, first flat row, end row, position of the first row)
    prompt_rows: list[tuple[PromptLogprobCollector, int, int, int]] = field(
        default_factory=list)


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, backend: str | None = None) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.backend = backend
        shape = (len(model.layers), 2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.kv_views = [(layer[0], layer[1]) for layer in self.kv_cache]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks in every layer before the step writes."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def prepare(self, sched: SchedulerOutput) -> StepBatch:
        """The step's flat batch, built on Python lists and turned into one tensor each.

        Why lists: a decode step of one stream has one token, and building its positions and
        slots with tensor ops took ~20 small torch calls (~0.13 ms of a ~3 ms step on the
        bundled model); a list costs microseconds per sequence, and a prefill chunk's few
        thousand entries stay far below its forward pass."""
        bs = self.block_size
        seqs = [s for s, _ in sched.scheduled]
        q_lens = [n for _, n in sched.scheduled]
        starts = [s.num_computed_tokens for s in seqs]
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq, start, n in zip(seqs, starts, q_lens, strict=True):
            chunk = seq.token_ids[start:start + n]
            if len(chunk) < n:  # the draft follows the last known token
                chunk += seq.draft_token_ids[:n - len(chunk)]
            tokens.extend(chunk)
            positions.extend(range(start, start + n))
            slots.extend(slot_run(seq.block_table, start, n, bs))
        cu = list(accumulate(q_lens, initial=0))
        width = max(len(s.block_table) for s in seqs)
        table = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        samples = [i for i, s in enumerate(seqs) if reaches_end(s, starts[i], q_lens[i])]
        rows = [r for i in samples
                for r in range(cu[i + 1] - 1 - len(seqs[i].draft_token_ids), cu[i + 1])]
        dev = self.device
        return StepBatch(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_table=torch.tensor(table, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([a + n for a, n in zip(starts, q_lens, strict=True)],
                                  dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            logits_indices=torch.tensor(rows, dtype=torch.long, device=dev),
            sample_seqs=[seqs[i] for i in samples],
            prompt_rows=prompt_rows(seqs, starts, q_lens, cu[:-1]),
        )

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """The final hidden state of every token of ``batch`` (writing their K/V)."""
        plan = plan_attention(batch.block_table, batch.seq_lens, batch.cu_seqlens_q,
                              self.block_size, num_tokens=len(batch.input_ids))
        ctx = AttentionContext(self.kv_views, batch.slot_mapping, batch.block_table,
                               batch.seq_lens, batch.cu_seqlens_q, plan, self.backend)
        return self.model(batch.input_ids, batch.positions, ctx)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """Run the step; returns (logits [rows, vocab] fp32, the sampling sequences): one row
        per sampling sequence, 1 + len(draft) for one with a draft, in sequence order."""
        self.copy_blocks(sched.copies)
        batch = self.prepare(sched)
        hidden = self.forward(batch)
        if batch.prompt_rows:
            self.collect_prompt_logprobs(batch, hidden)
        if not batch.sample_seqs:
            return hidden.new_empty((0, 0)), []
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        return logits.cpu() if logits.device.type != "cpu" else logits, batch.sample_seqs

    def collect_prompt_logprobs(self, batch: StepBatch, hidden: torch.Tensor) -> None:
        """The prompt rows of this step (every asking request at once) -> each collector."""
        rows = torch.cat([torch.arange(lo, hi) for _, lo, hi, _ in batch.prompt_rows])
        targets = torch.tensor([t for col, lo, hi, pos in batch.prompt_rows
                                for t in col.prompt_token_ids[pos + 1:pos + 1 + hi - lo]])
        k = max(col.k for col, *_ in batch.prompt_rows)
        dev = hidden.device
        out = compute_chunk_logprobs(self.model.compute_logits, hidden[rows.to(dev)],
                                     targets.to(dev), k)
        first = 0
        for col, lo, hi, _ in batch.prompt_rows:
            part = slice(first, first + hi - lo)
            first += hi - lo
            col.add(type(out)(out.token_logprobs[part], out.ranks[part],
                              out.top_logprobs[part, :col.k], out.top_ids[part, :col.k]))


def prompt_rows(seqs: list[Sequence], starts: list[int], q_lens: list[int], firsts: list[int]
                ) -> list[tuple[PromptLogprobCollector, int, int, int]]:
    """Which flat rows of this step feed prompt logprobs: a request's sample 0 chunk rows
    for prompt positions not collected yet."""
    out = []
    for seq, start, n, first in zip(seqs, starts, q_lens, firsts, strict=True):
        col = seq.request.prompt_logprobs
        if col is None or seq.index != 0 or col.done:
            continue
        lo, hi = col.rows_wanted(start, n)
        if lo < hi:
            out.append((col, first + lo, first + hi, start + lo))
    return out


def slot_run(block_table: list[int], start: int, n: int, block_size: int) -> list[int]:
    """The cache slots of positions ``start .. start + n - 1``: a range per block touched."""
    out: list[int] = []
    pos, end = start, start + n
    while pos < end:
        block, offset = divmod(pos, block_size)
        take = min(block_size - offset, end - pos)
        first = block_table[block] * block_size + offset
        out.extend(range(first, first + take))
        pos += take
    return out


def reaches_end(seq: Sequence, start: int, n: int) -> bool:
    """Does this chunk reach the sequence's last known token and its draft, if any (so its
    logits are needed)?"""
    return start + n == seq.num_tokens + len(seq.draft_token_ids)
