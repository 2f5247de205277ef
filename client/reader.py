"""Reading many output streams at once: all open handles of one AsyncClient share a few XREADs.

A backend holds thousands of jobs open; one blocked connection per handle would exhaust any
pool. Instead each ``Shard`` reads up to ``STREAMS_PER_READ`` output streams with one blocking
``XREAD`` (one command reads many streams) on one connection, and hands each stream's entries
to the handles reading it. A client with 10,000 handles in flight thus holds about ten
connections.

A blocked XREAD cannot learn of a stream added after it started, so every shard also reads a
tiny wake-up stream of its own (``Keys.wake``): adding a handle to a busy shard appends one
entry there, and the shard starts over with the new stream at once. A reader that does not
keep up has its stream left out of the reads until it drains what it was given, so memory stays
bounded by ``MAX_BUFFERED`` batches per handle. A Redis outage is waited out with backoff and
reading continues from each handle's cursor.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redis.exceptions import ResponseError

from pagedq.cancel import stop_tasks
from pagedq.client.connection import BACKOFF_BASE_S, BACKOFF_CAP_S, TRANSIENT
from pagedq.client.queue import stream_replies

if TYPE_CHECKING:
    from pagedq.client.protocol import Keys

Entries = list[tuple[str, dict[bytes, bytes]]]

STREAMS_PER_READ = 1000  # output streams one XREAD (one shard, one connection) reads at most
MAX_SHARDS = 64  # beyond STREAMS_PER_READ * MAX_SHARDS streams, shards grow instead
READ_COUNT = 512  # entries per stream per XREAD
BLOCK_MS = 1000
MAX_BUFFERED = 64  # batches a handle may leave unread before its stream is paused
WAKE_TTL_S = 60


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


CLOSE_TIMEOUT_S = 5.0  # the most close() waits for a shard's read loop to end


@dataclass(eq=False)
class Subscription:
    """One reader of one output stream: the entries after ``cursor``, batch by batch."""

    key: str
    cursor: str
    shard: Shard
    batches: asyncio.Queue = field(default_factory=asyncio.Queue)
    paused: bool = False
    reconnected: bool = False  # Redis was away since the last batch

    async def next(self, timeout: float | None) -> Entries:
        """The next batch of entries; raises TimeoutError after ``timeout`` seconds, or the
        error that made its stream unreadable (a key that is not a stream...)."""
        batch = await asyncio.wait_for(self.batches.get(), timeout)
        if self.paused and self.batches.qsize() <= MAX_BUFFERED // 2:
            self.paused = False
            self.shard.wake()
        if isinstance(batch, Exception):
            raise batch
        return batch

    def deliver(self, entries: Entries, read_from: str) -> None:
        """Take the entries after this reader's cursor, from a read that began at
        ``read_from``. A read that began past the cursor (another reader of the stream was
        further along when it started) skipped entries this one still needs: it takes nothing
        from it, and the next read starts from its cursor."""
        if _id_key(read_from) > _id_key(self.cursor):
            return
        fresh = [e for e in entries if _id_key(e[0]) > _id_key(self.cursor)]
        if fresh:
            self.cursor = fresh[-1][0]
            self.batches.put_nowait(fresh)
            self.paused = self.batches.qsize() >= MAX_BUFFERED

    def close(self) -> None:
        self.shard.remove(self)


class Shard:
    """Up to STREAMS_PER_READ streams, read by one task with one blocking XREAD at a time."""

    def __init__(self, reader: StreamReader, number: int):
        self.reader = reader
        self.subs: dict[str, list[Subscription]] = {}
        self.wake_key = reader.keys.wake(f"{reader.client_id}.{number}")
        self.wake_cursor = "0-0"
        self.task: asyncio.Task | None = None
        self.reading = False  # an XREAD is in flight: a new stream needs a wake-up
        self.waking = False

    def add(self, sub: Subscription) -> None:
        self.subs.setdefault(sub.key, []).append(sub)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self.run(), name=f"pagedq-reader-{self.wake_key}")
        else:
            self.wake()

    def remove(self, sub: Subscription) -> None:
        subs = self.subs.get(sub.key, [])
        if sub in subs:
            subs.remove(sub)
        if not subs:
            self.subs.pop(sub.key, None)

    def wake(self) -> None:
        """Make the blocked XREAD return now, so the next one reads the streams added since."""
        if self.reading and not self.waking:
            self.waking = True
            asyncio.create_task(self._wake())

    async def _wake(self) -> None:
        try:
            pipe = (await self.reader.connection()).pipeline(transaction=False)
            pipe.xadd(self.wake_key, {b"w": b"1"}, maxlen=1)
            pipe.expire(self.wake_key, WAKE_TTL_S)
            await pipe.execute()
        except Exception:  # Redis away: the XREAD returns within BLOCK_MS anyway
            pass
        finally:
            self.waking = False

    def streams(self) -> dict[str, str]:
        out = {}
        for key, subs in self.subs.items():
            live = [s.cursor for s in subs if not s.paused]
            if live:
                out[key] = min(live, key=_id_key)
        out[self.wake_key] = self.wake_cursor
        return out

    async def run(self) -> None:
        delay = BACKOFF_BASE_S
        while self.subs:
            redis = await self.reader.connection()
            streams = self.streams()
            self.reading = True
            try:
                reply = await redis.xread(streams, count=READ_COUNT, block=BLOCK_MS)
            except TRANSIENT:
                await asyncio.sleep(delay)
                delay = min(BACKOFF_CAP_S, delay * 2)
                continue
            except ResponseError as exc:
                await self._isolate(redis, streams, exc)
                continue
            finally:
                self.reading = False
            if delay > BACKOFF_BASE_S:  # back after an outage: tell every reader
                self._reconnected()
            delay = BACKOFF_BASE_S
            self._dispatch(reply, streams)

    def _reconnected(self) -> None:
        for subs in self.subs.values():
            for sub in subs:
                sub.reconnected = True
                sub.batches.put_nowait([])

    def _dispatch(self, reply: Any, streams: dict[str, str]) -> None:
        for stream, raw in stream_replies(reply):
            key = _s(stream)
            entries = [(_s(eid), fields) for eid, fields in raw]
            if key == self.wake_key:
                if entries:
                    self.wake_cursor = entries[-1][0]
                continue
            for sub in list(self.subs.get(key, [])):
                sub.deliver(entries, streams.get(key, "0-0"))

    async def _isolate(self, redis: Any, streams: dict[str, str], exc: ResponseError) -> None:
        """An XREAD failed for all its streams: fail only the readers of keys that are not
        streams (a clobbered key), or every reader when no key explains it (e.g. NOPERM)."""
        bad = []
        for key in streams:
            kind = _s(await redis.type(key))
            if kind not in ("stream", "none"):
                bad.append(key)
        for key in bad or [k for k in streams if k != self.wake_key]:
            for sub in self.subs.pop(key, []):
                sub.batches.put_nowait(ResponseError(f"cannot read {key}: {exc}"))
        if not bad:
            await asyncio.sleep(BACKOFF_BASE_S)


class StreamReader:
    """The shards of one client. ``subscribe`` a stream, read its ``Subscription``, close it."""

    def __init__(self, keys: Keys, connection: Any):
        self.keys = keys
        self.connection = connection  # async callable -> the redis client reads go through
        self.client_id = uuid.uuid4().hex[:16]
        self.shards: list[Shard] = []

    def subscribe(self, key: str, cursor: str) -> Subscription:
        shard = self._shard()
        sub = Subscription(key, cursor, shard)
        shard.add(sub)
        return sub

    def _shard(self) -> Shard:
        for shard in self.shards:
            if len(shard.subs) < STREAMS_PER_READ:
                return shard
        if len(self.shards) < MAX_SHARDS:
            self.shards.append(Shard(self, len(self.shards)))
            return self.shards[-1]
        return min(self.shards, key=lambda s: len(s.subs))

    @property
    def open_streams(self) -> int:
        return sum(len(s.subs) for s in self.shards)

    async def close(self) -> None:
        """Stop every shard and delete the wake-up streams."""
        tasks = [s.task for s in self.shards if s.task is not None and not s.task.done()]
        # cancelled until they end: one cancel can be lost on Python 3.11 (pagedq.cancel)
        await stop_tasks(tasks, CLOSE_TIMEOUT_S)
        if self.shards:
            try:
                await (await self.connection()).delete(*[s.wake_key for s in self.shards])
            except Exception:  # they expire on their own
                pass
        self.shards.clear()
