"""The pool of physical KV blocks: reference counts, a free list, and the prefix-cache index.

A block is *in use* while its reference count is > 0 (one per block table holding it). At count
0 it returns to the free list, but if it is full and hashed it stays findable in the cache index
until the pool needs it back: then the least recently freed block is evicted first (LRU).
Blocks without a hash go to the front of the free list, so cached ones are evicted last.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    """The pool is exhausted; callers check ``num_free`` first, so this signals a bug."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and registered in the cache
    tokens: tuple[int, ...] = ()  # the block's tokens, to rule out hash collisions on a hit


def hash_block(parent_hash: int | None, tokens: tuple[int, ...], salt: object = None) -> int:
    """Chained block hash: identifies a block by everything that determines its KV."""
    return hash((parent_hash, salt, tokens))


class BlockPool:
    """Fixed set of ``num_blocks`` blocks with O(1) allocate, free, cache lookup and eviction."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (including evictable cached ones)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - len(self._free)

    def allocate(self) -> int:
        """Take the least recently freed block, evicting its cache entry if it had one."""
        if not self._free:
            raise NoFreeBlocksError("KV block pool exhausted")
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash, block.tokens = None, ()
            self.num_evictions += 1
        block.ref_count = 1
        return block_id

    def acquire(self, block_id: int) -> None:
        """Add a user to a block (a prefix-cache hit or a fork); revives a freed cached block."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        """Drop one user; at zero the block is free (and, if hashed, still cached)."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} released more often than acquired")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.block_hash is None:
                self._free.move_to_end(block_id, last=False)  # reuse uncached blocks first

    def lookup(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        """The cached block holding exactly ``tokens`` after the same prefix, if any."""
        block_id = self._cached.get(block_hash)
        if block_id is None or self.blocks[block_id].tokens != tokens:
            return None
        return block_id

    def register(self, block_id: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        """Make a full block findable by its hash (first writer wins on duplicates)."""
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash, block.tokens = block_hash, tokens
        self._cached.setdefault(block_hash, block_id)

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def reset_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their data)."""
        for block in self.blocks:
            block.block_hash, block.tokens = None, ()
        self._cached.clear()
