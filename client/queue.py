"""The queue's streams as every party reads them: group creation, stream replies, depth, stats.

Clients (blocking and asyncio) and workers run the same Redis commands on a queue's job
streams; the commands are queued here on a pipeline the caller executes, and the replies are
read here, so the blocking client, the asyncio client and the worker's checkpoints can never
disagree about what a reply means. A pipeline's commands are queued the same way on redis-py's
blocking and asyncio pipelines; only ``execute()`` differs, and the caller runs it.
"""

from __future__ import annotations

import time
from typing import Any

from pagedq.client.protocol import GROUP, LEVELS, Keys, Request, job_fields

BUSYGROUP = "BUSYGROUP"  # XGROUP CREATE's error when the group exists: nothing to do


def create_groups(pipe: Any, keys: Keys) -> None:
    """Queue XGROUP CREATE ... MKSTREAM on every level's stream.

    The group starts at id 0, so jobs enqueued before any worker existed are delivered too.
    Execute with ``raise_on_error=False`` and pass the replies to ``check_groups``.
    """
    for stream in keys.all_jobs():
        pipe.xgroup_create(stream, GROUP, id="0", mkstream=True)


def check_groups(replies: list[Any]) -> None:
    """Raise the first error of ``create_groups``' replies other than BUSYGROUP."""
    for reply in replies:
        if isinstance(reply, Exception) and BUSYGROUP not in str(reply):
            raise reply


def enqueue(pipe: Any, keys: Keys, requests: list[Request]) -> None:
    """Queue each request's XADD on its priority level's stream (create the groups first)."""
    for req in requests:
        pipe.xadd(keys.jobs(req.level), job_fields(req))


def stream_replies(reply: Any) -> list[tuple[Any, list[Any]]]:
    """XREAD/XREADGROUP reply -> [(stream, entries)] under RESP2 (a list of pairs) and RESP3
    (a map of stream -> [entries]), so a ``?protocol=3`` URL works too."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [(stream, value[0] if value and isinstance(value[0], list) else value)
                for stream, value in reply.items()]
    return [(stream, entries) for stream, entries in reply]


def parse_entries(reply: Any) -> list[tuple[str, dict[bytes, bytes]]]:
    """XREAD's reply -> [(entry id, fields)]."""
    out = []
    for _stream, entries in stream_replies(reply):
        for entry_id, fields in entries:
            if isinstance(entry_id, bytes):
                entry_id = entry_id.decode()
            out.append((entry_id, fields))
    return out


# ---------------------------------------------------------------------------------------------
# Depth: how many jobs wait, per level
# ---------------------------------------------------------------------------------------------

DEPTH_REPLIES = 2 * len(LEVELS) + 1  # how many replies depth_query queues


def depth_query(pipe: Any, keys: Keys) -> None:
    """Queue what ``queue_depth`` reads: XLEN and XPENDING of each level, XLEN of the dead
    letters (``DEPTH_REPLIES`` commands)."""
    for stream in keys.all_jobs():
        pipe.xlen(stream)
        pipe.xpending(stream, GROUP)
    pipe.xlen(keys.dead)


def queue_depth(replies: list[Any]) -> dict[str, Any]:
    """Read ``depth_query``'s replies.

    A worker deletes each job entry when it acks it, so a stream holds exactly the jobs not yet
    delivered (its lag) and those delivered but not finished (its pending list):
    length = lag + pending. A reply that is an error (a stream or group not created yet) counts
    as 0. Returns ``{"depth", "pending", "levels": {level: {"length", "pending", "lag"}},
    "dead_letters"}``; ``depth`` sums the lags.
    """
    levels = {}
    for i, level in enumerate(LEVELS):
        length, pend = replies[2 * i], replies[2 * i + 1]
        length = length if isinstance(length, int) else 0
        pending = pend.get("pending", 0) if isinstance(pend, dict) else 0
        levels[level] = {"length": length, "pending": pending, "lag": max(0, length - pending)}
    dead = replies[2 * len(LEVELS)]
    return {
        "depth": sum(v["lag"] for v in levels.values()),
        "pending": sum(v["pending"] for v in levels.values()),
        "levels": levels,
        "dead_letters": dead if isinstance(dead, int) else 0,
    }


# ---------------------------------------------------------------------------------------------
# Stats: depth plus each live worker's checkpoint (two round trips)
# ---------------------------------------------------------------------------------------------


def stats_query(pipe: Any, keys: Keys) -> None:
    """Queue the first round trip of stats: the depth, the live workers' names, and the workers
    still loading their model."""
    depth_query(pipe, keys)
    pipe.zrange(keys.workers, 0, -1)
    pipe.zrange(keys.starting, 0, -1, withscores=True)


def _starting(reply: Any, now: float) -> int:
    """How many workers announce they are loading their model (claims not yet expired)."""
    if not isinstance(reply, list):
        return 0
    return sum(1 for item in reply if isinstance(item, (list, tuple)) and float(item[1]) > now)


def _worker_names(first: list[Any]) -> list[str]:
    return [n.decode() if isinstance(n, bytes) else str(n) for n in first[DEPTH_REPLIES]]


def workers_query(pipe: Any, keys: Keys, first: list[Any]) -> None:
    """Queue the second round trip: the checkpoint hash of each worker the first one named."""
    for name in _worker_names(first):
        pipe.hgetall(keys.worker(name))


def queue_stats(keys: Keys, first: list[Any], hashes: list[dict[bytes, bytes]]) -> dict[str, Any]:
    """Assemble ``stats()`` from both round trips; a worker whose hash expired is left out.
    ``starting`` counts the workers loading their model (not serving yet)."""
    workers = [parse_worker_hash(name, raw)
               for name, raw in zip(_worker_names(first), hashes, strict=True) if raw]
    return {"queue": keys.queue, **queue_depth(first[:DEPTH_REPLIES]), "workers": workers,
            "starting": _starting(first[DEPTH_REPLIES + 1], time.time())}


def _num(value: bytes | str) -> Any:
    text = value.decode() if isinstance(value, bytes) else value
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_worker_hash(name: str, raw: dict[bytes, bytes]) -> dict[str, Any]:
    """A worker's checkpoint hash with numbers as numbers."""
    info = {k.decode() if isinstance(k, bytes) else k: _num(v) for k, v in raw.items()}
    info["name"] = name
    return info
