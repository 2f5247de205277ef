"""Checkpoints: every ``interval`` seconds each worker writes its state to Redis with a TTL, so
``pagedq stats``/``Client.stats()`` see the fleet and a dead worker vanishes on its own.

Keys (documented in docs/queue.md)::

    P:Q:worker:NAME   hash, TTL = checkpoint_ttl: heartbeat, started, host, pid, model, state,
                      jobs, running, waiting, kv_blocks_used, kv_blocks_total, kv_usage,
                      kv_tokens_live, preemptions, tokens_per_s, generated_tokens, ...
    P:Q:workers       zset NAME -> heartbeat (stale members pruned), TTL = checkpoint_ttl
    P:Q:stats         hash, TTL = checkpoint_ttl: per level length/pending/lag, depth, pending,
                      dead_letters, updated (written by every worker; the latest wins)
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from redis.asyncio import Redis

from pagedq.client.protocol import GROUP, LEVELS, Keys

ENGINE_FIELDS = ("running", "waiting", "kv_blocks_used", "kv_blocks_total", "kv_usage",
                 "kv_tokens_live", "preemptions", "prefix_cache_queries", "prefix_cache_hits",
                 "num_generated_tokens")


class Checkpointer:
    def __init__(self, r: Redis, keys: Keys, name: str, ttl_s: float, model: str):
        self.r = r
        self.keys = keys
        self.name = name
        self.ttl_ms = int(ttl_s * 1000)
        self.static = {"name": name, "host": socket.gethostname(), "pid": os.getpid(),
                       "model": model, "started": time.time()}
        self._last_tokens: tuple[float, int] | None = None

    def tokens_per_s(self, generated_tokens: int) -> float:
        now = time.monotonic()
        last, self._last_tokens = self._last_tokens, (now, generated_tokens)
        if last is None or now <= last[0]:
            return 0.0
        return max(0.0, (generated_tokens - last[1]) / (now - last[0]))

    async def write(self, engine_stats: dict[str, Any], jobs: int, state: str,
                    generated_tokens: int, lock_key: str) -> dict[str, Any]:
        """Write this worker's hash and the queue's stats in one round trip; return the values."""
        now = time.time()
        fields: dict[str, Any] = dict(self.static)
        fields.update({k: engine_stats[k] for k in ENGINE_FIELDS if k in engine_stats})
        fields.update(heartbeat=now, state=state, jobs=jobs, generated_tokens=generated_tokens,
                      tokens_per_s=round(self.tokens_per_s(generated_tokens), 2))
        queue = await self._queue_stats()
        pipe = self.r.pipeline(transaction=True)  # readers never see a half-written hash
        key = self.keys.worker(self.name)
        pipe.delete(key)
        pipe.hset(key, mapping={k: str(v) for k, v in fields.items()})
        pipe.pexpire(key, self.ttl_ms)
        pipe.zadd(self.keys.workers, {self.name: now})
        pipe.zremrangebyscore(self.keys.workers, "-inf", now - self.ttl_ms / 1000)
        pipe.pexpire(self.keys.workers, self.ttl_ms)
        pipe.hset(self.keys.stats, mapping={k: str(v) for k, v in queue.items()})
        pipe.pexpire(self.keys.stats, self.ttl_ms)
        pipe.set(lock_key, self.name, px=self.ttl_ms)
        await pipe.execute()
        return {**fields, "queue": queue}

    async def _queue_stats(self) -> dict[str, Any]:
        pipe = self.r.pipeline(transaction=False)
        for stream in self.keys.all_jobs():
            pipe.xlen(stream)
            pipe.xpending(stream, GROUP)
        pipe.xlen(self.keys.dead)
        replies = await pipe.execute(raise_on_error=False)
        out: dict[str, Any] = {"updated": time.time()}
        depth = pending_total = 0
        for i, level in enumerate(LEVELS):
            length, pend = replies[2 * i], replies[2 * i + 1]
            length = length if isinstance(length, int) else 0
            pending = pend.get("pending", 0) if isinstance(pend, dict) else 0
            lag = max(0, length - pending)  # acked jobs are deleted: length = lag + pending
            out.update({f"length_{level}": length, f"pending_{level}": pending,
                        f"lag_{level}": lag})
            depth += lag
            pending_total += pending
        dead = replies[-1]
        out.update(depth=depth, pending=pending_total,
                   dead_letters=dead if isinstance(dead, int) else 0)
        return out

    async def remove(self, lock_key: str) -> None:
        """A clean stop: vanish from the fleet at once instead of after the TTL."""
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(self.keys.worker(self.name))
        pipe.zrem(self.keys.workers, self.name)
        pipe.delete(lock_key)
        await pipe.execute()
