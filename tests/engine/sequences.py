"""Model-free helpers: Sequences built by hand, and a step loop that stands in for the model.

The scheduler, KV manager and block pool only read token counts, block tables and request
priorities, so tests can drive them with these objects and no weights at all.
"""

from __future__ import annotations

import itertools
from collections import Counter

from pagedq.params import SamplingParams
from pagedq.worker.engine.block_pool import BlockPool
from pagedq.worker.engine.scheduler import Scheduler, SchedulerOutput
from pagedq.worker.engine.sequence import Request, SeqStatus, Sequence

_arrivals = itertools.count()


def make_seq(tokens: list[int] | int, *, priority: int = 0, max_tokens: int = 4,
             request_id: str | None = None) -> Sequence:
    """A fresh sequence of one request; an int makes a prompt of that many distinct tokens."""
    ids = list(range(100, 100 + tokens)) if isinstance(tokens, int) else list(tokens)
    arrival = next(_arrivals)
    req = Request(request_id or f"r{arrival}", None, ids,
                  SamplingParams(max_tokens=max_tokens, temperature=0.0),
                  priority=priority, arrival=arrival)
    seq = Sequence(req, 0, list(ids), len(ids))
    req.seqs.append(seq)
    return seq


def fake_step(sched: Scheduler, out: SchedulerOutput) -> list[Sequence]:
    """What the engine does after the forward pass, minus the model: computed tokens advance,
    full blocks are committed, sequences at their last known token get token 7, and those at
    max_tokens finish. Returns the sequences that finished."""
    finished = []
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        sched.kv.commit(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_generated >= seq.params.max_tokens:
                seq.status = SeqStatus.FINISHED
                sched.remove(seq)
                finished.append(seq)
    return finished


def assert_ref_counts(pool: BlockPool, seqs: list[Sequence]) -> None:
    """A block's reference count is the number of block tables holding it; free iff 0."""
    holders = Counter(b for s in seqs for b in s.block_table)
    for block in pool.blocks:
        assert block.ref_count == holders.get(block.block_id, 0), block
        assert (block.block_id in pool._free) == (block.ref_count == 0), block
