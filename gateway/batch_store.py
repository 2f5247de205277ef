"""Batch state in Redis: the one place a batch's progress lives (see batches.py for the keys
and the driver that moves it). The API routes and the driver both read and write it here."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from pagedq.gateway.api_errors import bad_request
from pagedq.gateway.openai import BatchCreateRequest

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
_WINDOW_RE = re.compile(r"^(\d+)h$")
BATCH_ID_RE = re.compile(r"^batch_[A-Za-z0-9_-]{1,128}$")
# KEYS: lease. ARGV: owner, ms. Take the lease if free, renew it if ours. -> 1 / 0.
LEASE = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] or not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""


class BatchKeys:
    """Batch keys; the set of batches to drive is per queue, so a gateway serving another queue
    of the same prefix never takes a batch over (its jobs would go to the wrong queue)."""

    def __init__(self, prefix: str, queue: str):
        self.prefix = prefix
        self.index = f"{prefix}:gw:batches"
        self.order = f"{prefix}:gw:batches:order"
        self.active = f"{prefix}:gw:batches:active:{queue}"

    def batch(self, bid: str) -> str:
        return f"{self.prefix}:gw:batch:{{{bid}}}"

    def part(self, bid: str, name: str) -> str:
        return f"{self.batch(bid)}:{name}"


def new_batch(bid: str, req: BatchCreateRequest, hours: int) -> dict[str, Any]:
    now = int(time.time())
    return {"id": bid, "object": "batch", "endpoint": req.endpoint, "errors": None,
            "input_file_id": req.input_file_id, "completion_window": req.completion_window,
            "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": now, "in_progress_at": None, "expires_at": now + hours * 3600,
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": req.metadata}


@dataclass
class BatchState:
    obj: dict[str, Any]
    total: int = 0
    next: int = 0
    cancel: bool = False
    inflight: dict[int, dict[str, Any]] = field(default_factory=dict)
    owner: str = ""  # the tenant that made it (its output files are theirs too)


class BatchStore:
    """Reads and writes batch state; the API and the driver both go through it."""

    def __init__(self, r: Redis, prefix: str, queue: str, files_ttl: int):
        self.r = r
        self.keys = BatchKeys(prefix, queue)
        self.ttl = files_ttl
        self.lease_script = r.register_script(LEASE)

    async def create(self, obj: dict[str, Any], owner: str = "") -> None:
        order = await self.r.incr(self.keys.order)  # lists newest first, even within a second
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(self.keys.batch(obj["id"]),
                  mapping={"obj": json.dumps(obj), "next": 0, "owner": owner})
        pipe.zadd(self.keys.index, {obj["id"]: order})
        pipe.sadd(self.keys.active, obj["id"])
        await pipe.execute()

    async def load(self, bid: str, with_inflight: bool = False) -> BatchState | None:
        if BATCH_ID_RE.match(bid) is None:  # no id of ours: no key is built from it
            return None
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(self.keys.batch(bid))
        pipe.hlen(self.keys.part(bid, "out"))
        pipe.hlen(self.keys.part(bid, "err"))
        if with_inflight:
            pipe.hgetall(self.keys.part(bid, "inflight"))
        raw, done, failed, *rest = await pipe.execute()
        if not raw or b"obj" not in raw:
            return None
        state = BatchState(json.loads(raw[b"obj"]), int(raw.get(b"total", 0)),
                           int(raw.get(b"next", 0)), raw.get(b"cancel") == b"1",
                           owner=raw.get(b"owner", b"").decode())
        if state.obj["status"] not in TERMINAL:
            state.obj["request_counts"] = {"total": state.total, "completed": done,
                                           "failed": failed}
            if state.cancel:
                state.obj.update(status="cancelling",
                                 cancelling_at=int(float(raw.get(b"cancel_at", 0))) or None)
        if rest:
            state.inflight = {int(k): json.loads(v) for k, v in rest[0].items()}
        return state

    async def save_obj(self, obj: dict[str, Any], **fields: Any) -> None:
        await self.r.hset(self.keys.batch(obj["id"]), mapping={"obj": json.dumps(obj), **fields})

    async def request_cancel(self, bid: str) -> None:
        await self.r.hset(self.keys.batch(bid), mapping={"cancel": 1, "cancel_at": time.time()})

    async def list(self, after: str | None, limit: int,
                   sees: Callable[[str], bool] = lambda owner: True
                   ) -> tuple[list[dict[str, Any]], bool]:
        """A page of the batches ``sees`` (a tenant's test of an owner), newest first."""
        ids = [i.decode() for i in await self.r.zrevrange(self.keys.index, 0, -1)]
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in ids else []
        out: list[dict[str, Any]] = []
        stale = []
        for bid in ids:
            if len(out) > limit:
                break
            state = await self.load(bid)
            if state is None:
                stale.append(bid)
            elif sees(state.owner):
                out.append(state.obj)
        if stale:
            await self.r.zrem(self.keys.index, *stale)
        return out[:limit], len(out) > limit

    async def active(self) -> list[str]:
        return sorted(m.decode() for m in await self.r.smembers(self.keys.active))

    async def lease(self, bid: str, owner: str, ms: int) -> bool:
        return bool(await self.lease_script(keys=[self.keys.part(bid, "lease")], args=[owner, ms]))


def completion_hours(window: str) -> int:
    m = _WINDOW_RE.match(window)
    if not m or not 1 <= int(m.group(1)) <= 24 * 30:
        raise bad_request("completion_window must be like '24h'", "completion_window")
    return int(m.group(1))
