"""Every Lua script of the protocol, and the EVALSHA runner that calls them.

A job's state changes atomically, in Redis, through these scripts only: clients cancel with
CANCEL; workers claim (CLAIM), write events (PUBLISH), keep (RENEW) and give back (HANDBACK)
jobs. Every write a worker makes on a job's behalf checks the job's fencing ``epoch`` in the
same script, so a worker that lost a job (its lease was reclaimed, it handed it back) can never
write to it again. They live on the client side because they are the protocol: another
language's client or worker runs the same source. State hash fields (``P:req:{ID}:state``):

    epoch        bumped by every claim and hand-back; the owner's fencing token
    owner        consumer name of the last claimant
    deliveries   claims that counted as a delivery (hand-backs do not)
    handed_back  1 between a hand-back and the next claim
    seq          events written so far (the next event gets seq + 1)
    done         1 once the terminal event is written
    cancel       1 once the client asked to cancel
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from pagedq.client.protocol import CANCELLED, Event, Keys, encode_event

# KEYS: state.  ARGV: owner, ttl.  -> {epoch, deliveries, seq, done, cancel}
CLAIM = """
local st = KEYS[1]
if redis.call('HGET', st, 'done') == '1' then return {0, 0, 0, 1, 0} end
local epoch = redis.call('HINCRBY', st, 'epoch', 1)
local deliveries
if redis.call('HGET', st, 'handed_back') == '1' then
  redis.call('HSET', st, 'handed_back', '0')
  deliveries = tonumber(redis.call('HGET', st, 'deliveries') or '0')
else
  deliveries = redis.call('HINCRBY', st, 'deliveries', 1)
end
redis.call('HSET', st, 'owner', ARGV[1])
redis.call('EXPIRE', st, ARGV[2])
local seq = tonumber(redis.call('HGET', st, 'seq') or '0')
local cancel = tonumber(redis.call('HGET', st, 'cancel') or '0')
return {epoch, deliveries, seq, 0, cancel}
"""

# KEYS: state, out, jobs stream.  ARGV: epoch, ttl, group, entry id, terminal (0/1), base seq,
# events...  The events get seq base+1, base+2, ...; those already written (seq <= the stored
# seq) are skipped, so a publish retried after a dropped connection never duplicates events.
# -> {1, cancel} written; {0, 0} fenced (no longer the owner, or already done); {-1, 0} the
# stream is behind base (a bug: the caller gives the job up rather than leave a gap).
# A terminal publish also acks and deletes the job entry: acked only once its end is written.
PUBLISH = """
local st = KEYS[1]
if redis.call('HGET', st, 'epoch') ~= ARGV[1] or redis.call('HGET', st, 'done') == '1' then
  return {0, 0}
end
local cur = tonumber(redis.call('HGET', st, 'seq') or '0')
local base = tonumber(ARGV[6])
if base > cur then return {-1, 0} end
for i = 7, #ARGV do
  local s = base + i - 6
  if s > cur then
    redis.call('XADD', KEYS[2], '*', 'seq', s, 'e', ARGV[i])
    cur = s
  end
end
redis.call('HSET', st, 'seq', cur)
if ARGV[5] == '1' then
  redis.call('HSET', st, 'done', '1')
  redis.call('XACK', KEYS[3], ARGV[3], ARGV[4])
  redis.call('XDEL', KEYS[3], ARGV[4])
end
redis.call('EXPIRE', st, ARGV[2])
if cur > 0 then redis.call('EXPIRE', KEYS[2], ARGV[2]) end
return {1, tonumber(redis.call('HGET', st, 'cancel') or '0')}
"""

# KEYS: stream1, state1, stream2, state2, ...  ARGV: group, consumer, id1, epoch1, id2, ...
# Resets the idle time of each job this worker still owns; returns the 1-based pair numbers
# it no longer owns.
RENEW = """
local lost = {}
for i = 1, #KEYS / 2 do
  local stream, st = KEYS[2 * i - 1], KEYS[2 * i]
  local id, epoch = ARGV[2 * i + 1], ARGV[2 * i + 2]
  local ok = false
  if redis.call('HGET', st, 'epoch') == epoch and redis.call('HGET', st, 'done') ~= '1' then
    ok = #redis.call('XCLAIM', stream, ARGV[1], ARGV[2], 0, id, 'JUSTID') > 0
  end
  if not ok then table.insert(lost, i) end
end
return lost
"""

# KEYS: state, jobs stream.  ARGV: epoch, group, entry id, ttl, field, value, field, value...
# Fences the caller out, re-adds the job at the stream's tail and acks the old entry, so an
# idle worker takes it at once; the next claim does not count it as a delivery. -> 1 / 0.
HANDBACK = """
local st = KEYS[1]
if redis.call('HGET', st, 'epoch') ~= ARGV[1] or redis.call('HGET', st, 'done') == '1' then
  return 0
end
redis.call('HINCRBY', st, 'epoch', 1)
redis.call('HSET', st, 'handed_back', '1')
redis.call('EXPIRE', st, ARGV[4])
local fields = {}
for i = 5, #ARGV do table.insert(fields, ARGV[i]) end
redis.call('XADD', KEYS[2], '*', unpack(fields))
redis.call('XACK', KEYS[2], ARGV[2], ARGV[3])
redis.call('XDEL', KEYS[2], ARGV[3])
return 1
"""

# KEYS: state, out.  ARGV: ttl seconds, encoded CANCELLED event.
# -> 0: already done; 1: flagged, the owning worker stops it and writes the terminal event;
# 2: no worker held it (never claimed, or handed back), so the terminal event is written here.
CANCEL = """
local st = KEYS[1]
if redis.call('HGET', st, 'done') == '1' then return 0 end
redis.call('HSET', st, 'cancel', '1')
redis.call('EXPIRE', st, ARGV[1])
if redis.call('HEXISTS', st, 'owner') == 0 or redis.call('HGET', st, 'handed_back') == '1' then
  local seq = redis.call('HINCRBY', st, 'seq', 1)
  redis.call('XADD', KEYS[2], '*', 'seq', seq, 'e', ARGV[2])
  redis.call('HSET', st, 'done', '1')
  redis.call('EXPIRE', KEYS[2], ARGV[1])
  return 2
end
return 1
"""
CANCEL_FLAGGED = 1  # CANCEL's reply when a worker holds the job: bump the cancel hint


def cancel_call(keys: Keys, request_id: str, ttl: int) -> dict[str, list[Any]]:
    """CANCEL's keys and args for ``request_id`` (for redis-py's ``Script(keys=, args=)``)."""
    event = encode_event(Event(type=CANCELLED, request_id=request_id))
    return {"keys": [keys.state(request_id), keys.out(request_id)], "args": [ttl, event]}


class LuaScript:
    """A script called by EVALSHA, loaded on first use and again after a NOSCRIPT reply
    (a Redis restart or SCRIPT FLUSH), without redis-py's extra SCRIPT EXISTS round trip."""

    def __init__(self, source: str):
        self.source = source
        self.sha: str | None = None

    async def load(self, r: Redis) -> None:
        self.sha = await r.script_load(self.source)

    async def __call__(self, r: Redis, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        if self.sha is None:
            await self.load(r)
        try:
            return await r.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self.load(r)
            return await r.evalsha(self.sha, len(keys), *keys, *args)

    def queue(self, pipe: Any, keys: Sequence[Any], args: Sequence[Any]) -> None:
        """Add a call to a pipeline (load() must have run once)."""
        pipe.evalsha(self.sha, len(keys), *keys, *args)


async def run_calls(r: Redis, calls: list[tuple[LuaScript, list[Any], list[Any]]]) -> list[Any]:
    """Run script calls in ONE pipelined round trip; calls that hit NOSCRIPT are retried after
    reloading (a NOSCRIPT call did nothing, and each job's events sit in a single call, so the
    retry keeps every job's order)."""
    for script, _, _ in calls:
        if script.sha is None:
            await script.load(r)
    results: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    for _attempt in range(3):
        pipe = r.pipeline(transaction=False)
        for i in todo:
            script, keys, args = calls[i]
            script.queue(pipe, keys, args)
        replies = await pipe.execute(raise_on_error=False)
        retry = []
        for i, reply in zip(todo, replies, strict=True):
            if isinstance(reply, NoScriptError):
                retry.append(i)
            else:
                results[i] = reply
        if not retry:
            return results
        for script in {calls[i][0] for i in retry}:
            await script.load(r)
        todo = retry
    raise RuntimeError("Redis keeps forgetting the worker's scripts (SCRIPT FLUSH in a loop?)")
