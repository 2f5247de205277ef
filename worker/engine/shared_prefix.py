"""Shared-prefix scheduling: a waiting request does not compute blocks a running one is computing.

The prefix cache knows a block only once a step has computed it (``KVCacheManager.commit``).
When many requests with one long prefix arrive together (a system prompt, a tool list: the
gateway's 64 tool calls share ~300 tokens), plain admission would let each of them prefill the
prefix in the same steps, so the prefix is computed once per request. Instead, each step the
scheduler indexes the full blocks its running sequences are about to compute, by chained hash
(``InflightBlocks``), and a waiting sequence whose next uncached blocks are among them is held
back: once the producer's step commits them, the waiter is admitted with them as prefix hits
and computes only its own tail. SGLang's scheduler does the same in spirit (it deprioritizes a
waiting request that shares a prefix with another request of the batch being built).

Why it cannot deadlock or starve: only *running* sequences are producers, and a running
sequence makes progress every step it gets budget (running sequences are scheduled first). A
producer that is preempted, aborted or finished leaves the running set, so it is out of the
next step's index and its waiters are admitted as usual (with whatever blocks it committed as
hits). A hold lasts while the producer is computing the waiter's next block, a bounded number of
steps, and a held sequence keeps its place in the waiting queue.

Holding pays when the prefix is really shared, not a coincidence of a few template tokens: a
waiter is held when its prefix hits plus the in-flight blocks right after them make at least
``MIN_SHARED_TOKENS`` tokens (SGLang's in-batch threshold is 32 tokens too); for less it
prefills alongside, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedq.worker.engine.kv_cache_manager import KVCacheManager
from pagedq.worker.engine.sequence import Sequence

MIN_SHARED_TOKENS = 32


@dataclass
class Producer:
    """A running sequence and the index of one block of its known tokens it will compute."""

    seq: Sequence
    block_index: int


@dataclass
class InflightBlocks:
    """Full blocks of known tokens that running sequences have not computed yet, by hash."""

    kv: KVCacheManager
    min_tokens: int = MIN_SHARED_TOKENS
    _by_hash: dict[int, Producer] = field(default_factory=dict)

    @classmethod
    def of(cls, kv: KVCacheManager, running: list[Sequence]) -> InflightBlocks:
        index = cls(kv)
        for seq in running:
            index.add(seq)
        return index

    def add(self, seq: Sequence) -> None:
        """Index the full blocks ``seq`` will compute (a sequence just admitted, or running)."""
        bs = self.kv.block_size
        first = seq.num_computed_tokens // bs
        last = seq.num_tokens // bs  # blocks past it are not full of known tokens yet
        if first >= last:
            return
        chain = self.kv.hash_chain(seq, last)
        for i in range(first, last):
            self._by_hash.setdefault(chain[i], Producer(seq, i))

    def producer_for(self, seq: Sequence, num_hit_blocks: int) -> Sequence | None:
        """The running sequence computing ``seq``'s next block after its ``num_hit_blocks``
        prefix hits, if hits plus the in-flight run after them make at least ``min_tokens``
        tokens; else None (``seq`` may go)."""
        if not self._by_hash:
            return None
        bs = self.kv.block_size
        chain = self.kv.hash_chain(seq, self.kv.num_matchable_blocks(seq))
        first: Producer | None = None
        for i in range(num_hit_blocks, len(chain)):
            found = self._by_hash.get(chain[i])
            if found is None or not self._same_tokens(seq, found, i):
                break
            first = first or found
            if (i + 1) * bs >= self.min_tokens:
                return first.seq
        return None

    def _same_tokens(self, seq: Sequence, found: Producer, i: int) -> bool:
        """Rules out a hash collision: the producer's block holds exactly ``seq``'s tokens."""
        bs = self.kv.block_size
        j = found.block_index
        return (j == i and found.seq.token_ids[j * bs:(j + 1) * bs]
                == seq.token_ids[i * bs:(i + 1) * bs])

    def __len__(self) -> int:
        return len(self._by_hash)
