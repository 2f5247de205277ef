"""Every Lua script of the protocol, and the EVALSHA runner that calls them.

A job's state changes atomically, in Redis, through these scripts only: clients submit
(SUBMIT) and cancel (CANCEL); workers claim (CLAIM), write events (PUBLISH), keep (RENEW) and
give back (HANDBACK) jobs. Every write a worker makes on a job's behalf checks the job's fencing
``epoch`` in the same script, so a worker that lost a job (its lease was reclaimed, it handed it
back) can never write to it again. Every key a script touches carries its queue's hash tag
(``P:{Q}:...``), so each script runs on one Redis Cluster slot. They live on the client side
because they are the protocol: another language's client or worker runs the same source.
State hash fields (``P:{Q}:req:ID:state``):

    digest       the job's payload digest (protocol.request_digest): one id, one job
    entry        the id of the job stream entry that carries the job now
    stream       the job stream holding that entry
    epoch        bumped by every claim and hand-back; the owner's fencing token
    owner        consumer name of the last claimant
    deliveries   claims that counted as a delivery (hand-backs do not)
    handed_back  1 between a hand-back and the next claim
    solo         runs on a worker alone (a suspect of killing its workers), see CLAIM
    seq          events written so far (the next event gets seq + 1)
    done         1 once the terminal event is written
    cancel       1 once the client asked to cancel
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from pagedq.client.protocol import CANCELLED, Event, Keys, encode_event

# KEYS: state, jobs stream.  ARGV: digest, ttl, field, value, field, value...
# -> {status, entry id}: SUBMITTED (the entry was added), JOINED (this job exists: the same
# payload was submitted before), ENDED (the same job ended already: its stream holds the
# result), DUPLICATE (the id belongs to another payload; nothing changes).
SUBMIT = """
local st = KEYS[1]
local digest = redis.call('HGET', st, 'digest')
if digest and digest ~= ARGV[1] then return {0, ''} end
if redis.call('HGET', st, 'done') == '1' then return {3, ''} end
if digest or redis.call('HEXISTS', st, 'entry') == 1 then
  return {2, redis.call('HGET', st, 'entry') or ''}
end
local fields = {}
for i = 3, #ARGV do table.insert(fields, ARGV[i]) end
local id = redis.call('XADD', KEYS[2], '*', unpack(fields))
redis.call('HSET', st, 'digest', ARGV[1], 'entry', id, 'stream', KEYS[2])
redis.call('EXPIRE', st, ARGV[2])
return {1, id}
"""
SUBMIT_DUPLICATE, SUBMITTED, SUBMIT_JOINED, SUBMIT_ENDED = 0, 1, 2, 3

# KEYS: state, jobs stream (the entry's).  ARGV: owner, ttl, digest ('' when the payload did
# not decode), entry id, max deliveries.
# -> {status, epoch, deliveries, seq, cancel, solo}. Status:
#   CLAIMED    the caller owns the job now: epoch bumped, a delivery counted unless the job was
#              handed back; ``solo`` counts the claims that came after max deliveries (the job
#              is a suspect: the caller runs it alone, and dead-letters it if a solo run died)
#   ENDED      the job's terminal event exists: ack the entry, nothing else
#   DUPLICATE  another payload holds this id: the entry is not this job (nothing changes)
#   SUPERSEDED another live entry carries this job: this entry is a duplicate (nothing changes)
CLAIM = """
local st = KEYS[1]
local digest = redis.call('HGET', st, 'digest')
if digest and digest ~= ARGV[3] then return {3, 0, 0, 0, 0, 0} end
if redis.call('HGET', st, 'done') == '1' then return {2, 0, 0, 0, 0, 0} end
local held = redis.call('HGET', st, 'entry')
if held and held ~= ARGV[4] and redis.call('HGET', st, 'handed_back') ~= '1' then
  local stream = redis.call('HGET', st, 'stream')
  if stream and #redis.call('XRANGE', stream, held, held) > 0 then return {4, 0, 0, 0, 0, 0} end
end
if not digest and ARGV[3] ~= '' then redis.call('HSET', st, 'digest', ARGV[3]) end
redis.call('HSET', st, 'entry', ARGV[4], 'stream', KEYS[2], 'owner', ARGV[1])
local epoch = redis.call('HINCRBY', st, 'epoch', 1)
local deliveries
local solo = tonumber(redis.call('HGET', st, 'solo') or '0')
if redis.call('HGET', st, 'handed_back') == '1' then
  redis.call('HSET', st, 'handed_back', '0')
  deliveries = tonumber(redis.call('HGET', st, 'deliveries') or '0')
else
  deliveries = redis.call('HINCRBY', st, 'deliveries', 1)
  if deliveries > tonumber(ARGV[5]) then solo = redis.call('HINCRBY', st, 'solo', 1) end
end
redis.call('EXPIRE', st, ARGV[2])
local seq = tonumber(redis.call('HGET', st, 'seq') or '0')
local cancel = tonumber(redis.call('HGET', st, 'cancel') or '0')
return {1, epoch, deliveries, seq, cancel, solo}
"""
CLAIMED, CLAIM_ENDED, CLAIM_DUPLICATE, CLAIM_SUPERSEDED = 1, 2, 3, 4

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
# Fences the caller out, re-adds the job at the stream's tail (the state follows the new entry)
# and acks the old entry, so an idle worker takes it at once; the next claim does not count it
# as a delivery. -> 1 / 0.
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
local id = redis.call('XADD', KEYS[2], '*', unpack(fields))
redis.call('HSET', st, 'entry', id, 'stream', KEYS[2])
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
CANCEL_ENDED, CANCEL_FLAGGED, CANCEL_UNOWNED = 0, 1, 2

# KEYS: the consumer's lock, then each job stream.  ARGV: group, consumer name.
# Deletes a consumer from every level's group once it holds nothing and no live worker uses its
# name; -> 1 deleted, 0 kept. (Deleting a consumer drops its pending entries, hence the checks
# in the same script.)
REAP = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 2, #KEYS do
  local ok, pending = pcall(redis.call, 'XPENDING', KEYS[i], ARGV[1], '-', '+', 1, ARGV[2])
  if ok and #pending > 0 then return 0 end
end
for i = 2, #KEYS do pcall(redis.call, 'XGROUP', 'DELCONSUMER', KEYS[i], ARGV[1], ARGV[2]) end
return 1
"""


def cancel_call(keys: Keys, request_id: str, ttl: int) -> tuple[list[Any], list[Any]]:
    """CANCEL's keys and args for ``request_id``."""
    event = encode_event(Event(type=CANCELLED, request_id=request_id))
    return [keys.state(request_id), keys.out(request_id)], [ttl, event]


class LuaScript:
    """A script called by EVALSHA, loaded on first use and again after a NOSCRIPT reply
    (a Redis restart, a failover, SCRIPT FLUSH), without redis-py's SCRIPT EXISTS round trip.

    Works on the blocking and asyncio clients, standalone or cluster (SCRIPT LOAD reaches
    every master there).
    """

    def __init__(self, source: str):
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def load(self, r: Redis) -> None:
        await r.script_load(self.source)

    async def __call__(self, r: Redis, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        try:
            return await r.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self.load(r)
            return await r.evalsha(self.sha, len(keys), *keys, *args)

    def call(self, r: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """The blocking client's call."""
        try:
            return r.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            r.script_load(self.source)
            return r.evalsha(self.sha, len(keys), *keys, *args)

    def queue(self, pipe: Any, keys: Sequence[Any], args: Sequence[Any]) -> None:
        """Add a call to a pipeline (as a raw command: redis-py's cluster pipelines refuse
        their ``evalsha`` method, yet route the command by its keys like any other)."""
        pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)


Call = tuple[LuaScript, Sequence[Any], Sequence[Any]]
MAX_RELOADS = 3


def _pipeline(r: Any, calls: list[Call], todo: list[int]) -> Any:
    pipe = r.pipeline(transaction=False)
    for i in todo:
        script, keys, args = calls[i]
        script.queue(pipe, keys, args)
    return pipe


def _sort_replies(todo: list[int], replies: list[Any], results: list[Any]) -> list[int]:
    """Store the replies; return the calls to send again (they hit NOSCRIPT, so did nothing)."""
    retry = []
    for i, reply in zip(todo, replies, strict=True):
        if isinstance(reply, NoScriptError):
            retry.append(i)
        else:
            results[i] = reply
    return retry


async def run_calls(r: Redis, calls: list[Call]) -> list[Any]:
    """Run script calls in ONE pipelined round trip; calls that hit NOSCRIPT are retried after
    reloading (a NOSCRIPT call did nothing, and each job's events sit in a single call, so the
    retry keeps every job's order). A reply that is an error is returned, not raised."""
    results: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    for _attempt in range(MAX_RELOADS):
        replies = await _pipeline(r, calls, todo).execute(raise_on_error=False)
        todo = _sort_replies(todo, replies, results)
        if not todo:
            return results
        for script in {calls[i][0] for i in todo}:
            await script.load(r)
    raise RuntimeError("Redis keeps forgetting the scripts (SCRIPT FLUSH in a loop?)")


def run_calls_blocking(r: Any, calls: list[Call]) -> list[Any]:
    """``run_calls`` on a blocking client."""
    results: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    for _attempt in range(MAX_RELOADS):
        replies = _pipeline(r, calls, todo).execute(raise_on_error=False)
        todo = _sort_replies(todo, replies, results)
        if not todo:
            return results
        for script in {calls[i][0] for i in todo}:
            r.script_load(script.source)
    raise RuntimeError("Redis keeps forgetting the scripts (SCRIPT FLUSH in a loop?)")
