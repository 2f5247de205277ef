"""Checkpoints: each worker's state and the queue's depth, written to Redis with a TTL.

``pagedq stats`` and ``Client.stats()`` read them to show the fleet, autoscalers read the
depth, and because every key expires unless refreshed, a dead worker vanishes on its own.
The same TTL holds the worker's consumer name (``claim_name``): a restarted worker gets its
old name back, and with it its own pending jobs, while two live workers never share one.

Keys (docs/queue.md)::

    P:{Q}:worker:NAME  hash, TTL = checkpoint_ttl: heartbeat, started, host, pid, model, state,
                       jobs, running, waiting, kv_blocks_used, kv_blocks_total, kv_usage,
                       kv_tokens_live, preemptions, generated_tokens, tokens_per_s, ...
    P:{Q}:workers      zset NAME -> heartbeat (stale members pruned), TTL = checkpoint_ttl
    P:{Q}:stats        hash, TTL = checkpoint_ttl: per level length/pending/lag, depth,
                       pending, dead_letters, updated (every worker writes it; the latest wins)
    P:{Q}:lock:NAME    NAME, TTL = checkpoint_ttl: the consumer name is taken
    P:{Q}:starting     zset host:pid -> expiry (unix s), TTL = checkpoint_ttl: workers still
                       loading their model (``Starting``), so `pagedq submit` waits for them
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections import deque
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from pagedq.cancel import stop_tasks
from pagedq.client.protocol import Keys
from pagedq.client.queue import depth_query, queue_depth
from pagedq.logging import get_logger
from pagedq.worker.service.shared import Part, Shared

log = get_logger(__name__)

ENGINE_FIELDS = ("running", "waiting", "kv_blocks_used", "kv_blocks_total", "kv_usage",
                 "kv_tokens_live", "preemptions", "prefix_cache_queries", "prefix_cache_hits",
                 # speculative decoding, when the engine speculates (engine.md)
                 "spec_method", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens", "spec_decode_acceptance_rate",
                 "spec_decode_mean_acceptance_length", "spec_suffix_requests",
                 "spec_suffix_tokens")
MAX_NAME_SUFFIX = 1000
STOP_TIMEOUT_S = 1.0  # the most a stopping worker waits to withdraw its start announcement
RATE_WINDOW_S = 10.0  # tokens_per_s averages over this long: tokens are published in bursts


class Rate:
    """A counter's rate over the last RATE_WINDOW_S seconds.

    Tokens reach Redis in bursts (one publish per batch of steps), so the change since the
    previous checkpoint alone would swing between 0 and twice the real rate.
    """

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self.samples: deque[tuple[float, int]] = deque()

    def update(self, count: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self.samples.append((now, count))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        t0, c0 = self.samples[0]
        return max(0.0, (count - c0) / (now - t0)) if now > t0 else 0.0


async def claim_name(r: Redis, keys: Keys, base: str, ttl_s: float) -> str:
    """``base``, or ``base-2``, ``base-3``, ... while a live worker holds the smaller ones."""
    for i in range(MAX_NAME_SUFFIX):
        name = base if i == 0 else f"{base}-{i + 1}"
        if await r.set(keys.lock(name), name, nx=True, px=int(ttl_s * 1000)):
            return name
    raise RuntimeError(f"{MAX_NAME_SUFFIX} live workers already use the consumer name {base!r}")


class Starting:
    """A worker loading its model says so: ``P:{Q}:starting`` holds ``host:pid`` until the
    first checkpoint (or a failed load) removes it, or its claim expires (a worker killed while
    loading). ``pagedq submit`` right after ``pagedq worker`` then says "a worker is starting"
    and waits, instead of "no worker". Advisory: a Redis error here is logged, never fatal."""

    def __init__(self, r: Redis, keys: Keys, ttl_s: float, interval_s: float):
        self.r = r
        self.key = keys.starting
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self.member = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._announce(), name="starting")

    async def _announce(self) -> None:
        while True:
            now = time.time()
            try:
                pipe = self.r.pipeline(transaction=False)
                pipe.zadd(self.key, {self.member: now + self.ttl_s})
                pipe.zremrangebyscore(self.key, "-inf", now)
                pipe.pexpire(self.key, int(self.ttl_s * 1000))
                await pipe.execute()
            except RedisError as exc:
                log.debug("could not announce the start", error=repr(exc))
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        """Serving (its first checkpoint is written) or given up: withdraw the claim."""
        if self._task is None:
            return
        task, self._task = self._task, None
        # and wait for it (an announcement in flight would re-add the claim), cancelling again:
        # one cancel can be lost on Python 3.11 (pagedq.cancel), and a lost one hung the start
        if await stop_tasks([task], STOP_TIMEOUT_S):
            log.warning("the start announcement did not stop; its claim expires on its own")
        try:
            # bounded: a SIGTERM while loading exits at once whatever Redis does
            await asyncio.wait_for(self.r.zrem(self.key, self.member), STOP_TIMEOUT_S)
        except (TimeoutError, RedisError) as exc:
            log.debug("could not withdraw the start (it expires on its own)", error=repr(exc))


class Checkpoints(Part):
    """Writes this worker's checkpoint every ``interval`` seconds; removes it on a clean stop."""

    def __init__(self, shared: Shared, r: Redis, keys: Keys, name: str, model: str):
        super().__init__(shared)
        self.interval = shared.config.checkpoint_interval
        self.ttl_ms = int(shared.config.checkpoint_ttl_s * 1000)
        self.r = r
        self.keys = keys
        self.name = name
        self.static = {"name": name, "host": socket.gethostname(), "pid": os.getpid(),
                       "model": model, "started": time.time()}
        self.ok = False  # the last write succeeded
        self.rate = Rate()

    async def tick(self) -> None:
        await asyncio.sleep(self.interval)
        await self.write()

    async def write(self) -> None:
        """Write this worker's hash and the queue's stats in one transaction."""
        try:
            await self._write()
        except BaseException:
            self.ok = False
            raise
        self.ok = True

    async def _write(self) -> None:
        now = time.time()
        generated = self.metrics.generation_tokens
        fields: dict[str, Any] = dict(self.static)
        fields.update({k: self.metrics.engine[k] for k in ENGINE_FIELDS if k in self.metrics.engine})
        fields.update(heartbeat=now, state="draining" if self.stopping.is_set() else "serving",
                      jobs=len(self.jobs), generated_tokens=generated,
                      tokens_per_s=round(self.rate.update(generated), 2))
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
        pipe.set(self.keys.lock(self.name), self.name, px=self.ttl_ms)
        await pipe.execute()
        self.metrics.queue = queue

    async def _queue_stats(self) -> dict[str, Any]:
        """The queue's depth as flat hash fields: ``length_<level>``, ``pending_<level>``,
        ``lag_<level>``, ``depth``, ``pending``, ``dead_letters``, ``updated``."""
        pipe = self.r.pipeline(transaction=False)
        depth_query(pipe, self.keys)
        depth = queue_depth(await pipe.execute(raise_on_error=False))
        out: dict[str, Any] = {"updated": time.time()}
        for level, counts in depth["levels"].items():
            out.update({f"{name}_{level}": value for name, value in counts.items()})
        out.update(depth=depth["depth"], pending=depth["pending"],
                   dead_letters=depth["dead_letters"])
        return out

    async def remove(self) -> None:
        """A clean stop: vanish from the fleet and free the name at once, not after the TTL."""
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(self.keys.worker(self.name))
        pipe.zrem(self.keys.workers, self.name)
        pipe.delete(self.keys.lock(self.name))
        await pipe.execute()
