"""Maps sequences' token positions onto pool blocks: allocation, prefix hits, copy-on-write.

A sequence's block table grows only as tokens are scheduled, one block per ``block_size``
tokens. Full blocks get a chained hash so later requests with the same prefix reuse them.
A block shared by several sequences (prefix hit, n > 1 fork, beam) is read-only: the first
sequence that must write into it gets a private copy (copy-on-write), recorded in
``pending_copies`` for the model runner to apply before the step's KV writes.
"""

from __future__ import annotations

from pagedq.worker.engine.block_pool import BlockPool, hash_block
from pagedq.worker.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the BlockPool and every sequence's block table."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.pending_copies: list[tuple[int, int]] = []  # (src block, dst block) this step
        self.prefix_cache_queries = 0  # prompt tokens looked up (vLLM's counters: in tokens)
        self.prefix_cache_hits = 0

    # -- prefix cache ---------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Longest run of cached full blocks for a fresh sequence: (block ids, their hashes).

        At least one token is left uncached: the step must compute it to produce logits. A
        request still collecting prompt logprobs takes no hit: it needs every prompt row.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return [], []
        if seq.request.prompt_logprobs is not None and not seq.request.prompt_logprobs.done:
            return [], []
        bs = self.block_size
        chain = self.hash_chain(seq, self.num_matchable_blocks(seq))
        blocks: list[int] = []
        for i, h in enumerate(chain):
            block_id = self.pool.lookup(h, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks, chain[:len(blocks)]

    def num_matchable_blocks(self, seq: Sequence) -> int:
        """Full blocks a fresh sequence could take from the cache: all but the last token's."""
        return (seq.num_tokens - 1) // self.block_size

    def hash_chain(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The chained hashes of ``seq``'s first ``num_blocks`` full blocks of known tokens.

        Kept on the sequence (``token_block_hashes``) so a request waiting through many steps
        hashes its prompt once; token ids are only ever appended, except when a resumed
        sequence is replayed, so entries past the current full blocks are dropped first.
        """
        bs = self.block_size
        chain = seq.token_block_hashes
        del chain[seq.num_tokens // bs:]
        for i in range(len(chain), min(num_blocks, seq.num_tokens // bs)):
            chain.append(hash_block(chain[i - 1] if i else None,
                                    tuple(seq.token_ids[i * bs:(i + 1) * bs])))
        return chain[:num_blocks]

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    # -- allocation -----------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int, num_hit_blocks: int = 0) -> int:
        """Free blocks that scheduling ``num_new_tokens`` more tokens would consume."""
        computed = max(seq.num_computed_tokens, num_hit_blocks * self.block_size)
        total = computed + num_new_tokens
        need = max(0, cdiv(total, self.block_size) - max(len(seq.block_table), num_hit_blocks))
        return need + (1 if self._cow_index(seq) is not None else 0)

    def allocate(self, seq: Sequence, num_new_tokens: int,
                 hit: tuple[list[int], list[int]] | None = None) -> bool:
        """Give ``seq`` slots for ``num_new_tokens`` more tokens; all or nothing.

        ``hit`` is a prefix-cache match (from ``match_prefix``) to adopt first.
        """
        hit_blocks, hit_hashes = hit or ([], [])
        revived = sum(1 for b in hit_blocks if self.pool.ref_count(b) == 0)
        if self.blocks_needed(seq, num_new_tokens, len(hit_blocks)) + revived > self.pool.num_free:
            return False
        for block_id in hit_blocks:
            self.pool.acquire(block_id)
        if hit_blocks:
            seq.block_table = list(hit_blocks)
            seq.block_hashes = list(hit_hashes)
            seq.num_computed_tokens = len(hit_blocks) * self.block_size
        cow = self._cow_index(seq)
        if cow is not None:
            src = seq.block_table[cow]
            dst = self.pool.allocate()
            self.pending_copies.append((src, dst))
            self.pool.release(src)
            seq.block_table[cow] = dst
        total = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) < cdiv(total, self.block_size):
            seq.block_table.append(self.pool.allocate())
        return True

    def _cow_index(self, seq: Sequence) -> int | None:
        """Index of the partly filled, shared block the next token would write into, if any."""
        idx = seq.num_computed_tokens // self.block_size
        if idx < len(seq.block_table) and self.pool.ref_count(seq.block_table[idx]) > 1:
            return idx
        return None

    def share(self, parent: Sequence, child: Sequence) -> None:
        """A fork: ``child`` holds the same blocks as ``parent`` (one more user each)."""
        for block_id in parent.block_table:
            self.pool.acquire(block_id)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)

    def commit(self, seq: Sequence) -> None:
        """Register the blocks that just became full of computed tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        chain = self.hash_chain(seq, num_full)  # each block hashed once, shared with admission
        for i in range(len(seq.block_hashes), num_full):
            self.pool.register(seq.block_table[i], chain[i], tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            seq.block_hashes.append(chain[i])

    def trim(self, seq: Sequence) -> int:
        """Speculative rollback: release the tail blocks past the sequence's computed tokens
        (they held rejected draft tokens' KV); returns how many were released. Rejected slots
        inside the kept last block are overwritten by the next tokens, and no block holding
        them was registered in the prefix cache (``commit`` registers computed tokens only)."""
        keep = cdiv(seq.num_computed_tokens, self.block_size)
        tail = seq.block_table[keep:]
        for block_id in reversed(tail):
            self.pool.release(block_id)
        del seq.block_table[keep:]
        return len(tail)

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks, tail first so the tail is evicted before the prefix."""
        for block_id in reversed(seq.block_table):
            self.pool.release(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # -- accounting -----------------------------------------------------------------------
    def stats(self, running: list[Sequence]) -> dict[str, int | float]:
        pool = self.pool
        return {"kv_blocks_total": pool.num_blocks, "kv_blocks_used": pool.num_used,
                "kv_blocks_free": pool.num_free, "kv_tokens_live": self.live_tokens(running),
                "kv_usage": pool.num_used / pool.num_blocks, "block_size": self.block_size,
                "prefix_cache_queries": self.prefix_cache_queries,
                "prefix_cache_hits": self.prefix_cache_hits,
                "prefix_cache_evictions": pool.num_evictions}

    def live_tokens(self, seqs: list[Sequence]) -> int:
        """Slots holding computed KV of running sequences, shared blocks counted once."""
        bs = self.block_size
        filled: dict[int, int] = {}
        for seq in seqs:
            n = seq.num_computed_tokens
            for i, block_id in enumerate(seq.block_table):
                f = min(bs, n - i * bs)
                if f <= 0:
                    break
                if filled.get(block_id, 0) < f:
                    filled[block_id] = f
        return sum(filled.values())
