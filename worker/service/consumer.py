"""Pulling jobs: the consumer group reads, highest priority first, only what the engine can admit.

``read`` takes at most ``capacity`` new entries (XREADGROUP COUNT), so jobs this worker could
not start stay in the stream for other workers. ``reclaim`` takes over jobs whose owner stopped
renewing them (XAUTOCLAIM), ``own_pending`` re-reads this consumer's own unacked entries
after a restart under the same (stable) consumer name, and ``reap`` deletes the consumers of
dead workers once nothing is pending on them. ``dead_letter`` keeps an entry for inspection
within a byte budget, so garbage input cannot fill a Redis that does not evict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from pagedq.client.protocol import GROUP, LEVELS, Keys
from pagedq.client.queue import check_groups, create_groups, stream_replies
from pagedq.client.scripts import REAP, LuaScript
from pagedq.logging import get_logger

log = get_logger("pagedq.worker.consumer")

REASON_CHARS = 2000  # of a dead letter's reason
DEAD_LETTER_OVERHEAD = 2048  # bytes of a dead letter besides the job's fields, at most


@dataclass
class Entry:
    """One job stream entry as delivered to this worker."""

    stream: str
    entry_id: str
    fields: dict[bytes, bytes] | None  # None: the entry was deleted while pending


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _fields(raw: Any) -> dict[bytes, bytes] | None:
    if raw is None:
        return None
    if isinstance(raw, dict):
        return raw
    return {raw[i]: raw[i + 1] for i in range(0, len(raw) - 1, 2)}


def parse_autoclaim(reply: list[Any]) -> tuple[str, list[tuple[str, dict]], list[str], int]:
    """Parse a raw XAUTOCLAIM reply. Redis 7.0+ answers ``[cursor, entries, deleted ids]`` and
    drops deleted-while-pending ids from the pending list itself; 6.2 answers
    ``[cursor, entries]`` with a bare nil per deleted entry, which stays pending.

    Returns (next cursor, [(entry id, fields)], deleted ids, count of nil entries).
    """
    cursor = _s(reply[0])
    entries: list[tuple[str, dict]] = []
    deleted: list[str] = [_s(x) for x in reply[2]] if len(reply) > 2 and reply[2] else []
    nils = 0
    for item in reply[1] or []:
        fields = _fields(item[1]) if item is not None and len(item) > 1 else None
        if item is None or item[0] is None:
            nils += 1
        elif fields is None:
            deleted.append(_s(item[0]))
        else:
            entries.append((_s(item[0]), fields))
    return cursor, entries, deleted, nils


class Consumer:
    """Reads one queue's job streams as one stable consumer of the group."""

    def __init__(self, r: Redis, keys: Keys, name: str, dead_letter_entry_bytes: int = 8192,
                 dead_letter_max_bytes: int = 32 << 20):
        self.r = r
        self.keys = keys
        self.name = name
        self.streams = keys.all_jobs()
        self.entry_bytes = dead_letter_entry_bytes
        self.dead_maxlen = max(1, dead_letter_max_bytes // (dead_letter_entry_bytes
                                                             + DEAD_LETTER_OVERHEAD))
        self._reap = LuaScript(REAP)
        # redis-py's XAUTOCLAIM parser assumes every entry has fields, but Redis 6.2 returns
        # deleted-while-pending entries with nil fields: take the raw reply and parse it here.
        r.response_callbacks.pop("XAUTOCLAIM", None)

    async def ensure_groups(self) -> None:
        """Create the streams and the consumer group unless they exist."""
        pipe = self.r.pipeline(transaction=False)
        create_groups(pipe, self.keys)
        check_groups(await pipe.execute(raise_on_error=False))

    async def read(self, capacity: int, block_ms: int) -> list[Entry]:
        """Up to ``capacity`` new entries, higher levels first; blocks only when all are empty."""
        out = await self._read_levels(capacity)
        if out or block_ms <= 0:
            return out
        # Nothing anywhere: wait for the first new entry on any level (COUNT 1), then take the
        # rest of a burst in priority order at once, so jobs submitted together start together.
        first = await self._read({s: ">" for s in self.streams}, 1, block_ms)
        return first + (await self._read_levels(capacity - 1) if first else [])

    async def _read_levels(self, capacity: int) -> list[Entry]:
        out: list[Entry] = []
        for stream in self.streams:
            if len(out) >= capacity:
                break
            out += await self._read({stream: ">"}, capacity - len(out), None)
        return out

    async def own_pending(self) -> list[Entry]:
        """Entries delivered to this consumer name and never acked (a restart after a crash)."""
        out: list[Entry] = []
        for stream in self.streams:
            out += await self._read({stream: "0"}, 10_000, None)
        return out

    async def _read(self, streams: dict[str, str], count: int, block: int | None) -> list[Entry]:
        try:
            reply = await self.r.xreadgroup(GROUP, self.name, streams, count=count, block=block)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("consumer group missing (Redis restarted or flushed?); recreating it")
            await self.ensure_groups()
            return []
        entries = []
        for stream, items in stream_replies(reply):
            for entry_id, fields in items:
                entries.append(Entry(_s(stream), _s(entry_id), _fields(fields) or None))
        return entries

    async def reclaim(self, capacity: int, min_idle_ms: int) -> list[Entry]:
        """Take over up to ``capacity`` entries idle for ``min_idle_ms`` (their owner is gone)."""
        out: list[Entry] = []
        for stream in self.streams:
            cursor = "0-0"
            while len(out) < capacity:
                try:
                    reply = await self.r.execute_command(
                        "XAUTOCLAIM", stream, GROUP, self.name, min_idle_ms, cursor,
                        "COUNT", capacity - len(out))
                except ResponseError as exc:
                    if "NOGROUP" not in str(exc):
                        raise
                    await self.ensure_groups()
                    break
                cursor, entries, deleted, nils = parse_autoclaim(reply)
                out += [Entry(stream, eid, f) for eid, f in entries]
                out += [Entry(stream, eid, None) for eid in deleted]
                if nils:
                    out += await self._deleted_pending(stream, {e.entry_id for e in out})
                if cursor == "0-0":
                    break
        return out

    async def _deleted_pending(self, stream: str, known: set[str]) -> list[Entry]:
        """Redis 6.2: find the ids of entries we just claimed that no longer exist."""
        pending = await self.r.xpending_range(stream, GROUP, "-", "+", 1000, self.name)
        out = []
        for p in pending:
            entry_id = _s(p["message_id"])
            if entry_id not in known and not await self.r.xrange(stream, entry_id, entry_id):
                out.append(Entry(stream, entry_id, None))
        return out

    async def ack_delete(self, stream: str, entry_id: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.xack(stream, GROUP, entry_id)
        pipe.xdel(stream, entry_id)
        await pipe.execute()

    async def dead_letter(self, entry: Entry, reason: str, ack: bool = True) -> None:
        """Copy an entry to the dead-letter stream (with why) and, with ``ack``, drop it from
        the queue. Without ``ack`` the caller's terminal publish acks it.

        The entry's own fields keep at most ``dead_letter_entry_bytes`` (``truncated`` then
        holds their full size), and the stream at most ``dead_letter_max_bytes`` in all.
        """
        fields = self._dead_fields(entry, reason)
        pipe = self.r.pipeline(transaction=False)
        pipe.xadd(self.keys.dead, fields, maxlen=self.dead_maxlen, approximate=False)
        if ack:
            pipe.xack(entry.stream, GROUP, entry.entry_id)
            pipe.xdel(entry.stream, entry.entry_id)
        await pipe.execute()

    def _dead_fields(self, entry: Entry, reason: str) -> dict[Any, Any]:
        fields: dict[Any, Any] = {b"stream": entry.stream, b"entry_id": entry.entry_id,
                                  b"reason": reason[:REASON_CHARS] or "unknown",
                                  b"consumer": self.name}
        budget, total = self.entry_bytes, 0
        for k, v in (entry.fields or {}).items():
            total += len(k) + len(v)
            if k in fields or budget <= len(k):
                continue
            kept = v[:budget - len(k)]
            fields[k] = kept
            budget -= len(k) + len(kept)
        if total > self.entry_bytes:
            fields[b"truncated"] = total
        return fields

    async def reap(self, min_idle_ms: int) -> list[str]:
        """Delete the consumers idle for ``min_idle_ms`` that hold nothing and whose name no
        live worker holds (dead workers whose pending jobs were reclaimed); returns them."""
        names: set[str] = set()
        for stream in self.streams:
            try:
                consumers = await self.r.xinfo_consumers(stream, GROUP)
            except ResponseError:  # no stream or group yet
                continue
            for c in consumers:
                name = _s(c["name"])
                if name != self.name and not c["pending"] and c["idle"] >= min_idle_ms:
                    names.add(name)
        reaped = []
        for name in sorted(names):
            if await self._reap(self.r, [self.keys.lock(name), *self.streams], [GROUP, name]):
                reaped.append(name)
        if reaped:
            log.info("removed dead consumers from the group", consumers=reaped)
        return reaped


__all__ = ["Consumer", "Entry", "LEVELS", "parse_autoclaim"]
