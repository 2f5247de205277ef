"""The protocol's Lua scripts against a real Redis: each script's contract (docs/queue.md), and
the EVALSHA runner reloading scripts Redis forgot."""

from __future__ import annotations

import asyncio

import pytest
import redis

from pagedq.client.protocol import (
    CANCELLED,
    GROUP,
    TOKENS,
    Event,
    Keys,
    build_request,
    decode_event,
    encode_event,
    job_fields,
)
from pagedq.client.scripts import (
    CANCEL,
    CANCEL_FLAGGED,
    CLAIM,
    HANDBACK,
    PUBLISH,
    RENEW,
    LuaScript,
    cancel_call,
    run_calls,
)

KEYS = Keys()
TTL = 60


@pytest.fixture
def job(redis_client):
    """A job enqueued and delivered to consumer "w": (request, stream, entry id)."""
    req = build_request([1, 2])
    stream = KEYS.jobs("normal")
    redis_client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    eid = redis_client.xadd(stream, job_fields(req)).decode()
    redis_client.xreadgroup(GROUP, "w", {stream: ">"})
    return req, stream, eid


def claim(r, rid, owner="w"):
    return [int(x) for x in r.register_script(CLAIM)(keys=[KEYS.state(rid)], args=[owner, TTL])]


def publish(r, rid, stream, eid, epoch, base, tokens, terminal=False):
    events = [encode_event(Event(type=TOKENS, request_id=rid, token_ids=[t])) for t in tokens]
    reply = r.register_script(PUBLISH)(
        keys=[KEYS.state(rid), KEYS.out(rid), stream],
        args=[epoch, TTL, GROUP, eid, int(terminal), base, *events])
    return [int(x) for x in reply]


def out_tokens(r, rid):
    return [(int(f[b"seq"]), decode_event(f).token_ids) for _, f in r.xrange(KEYS.out(rid))]


def test_claim_bumps_the_epoch_and_counts_deliveries(redis_client, job):
    req, _, _ = job
    assert claim(redis_client, req.id) == [1, 1, 0, 0, 0]  # epoch, deliveries, seq, done, cancel
    assert claim(redis_client, req.id, "other") == [2, 2, 0, 0, 0]
    assert redis_client.hget(KEYS.state(req.id), "owner") == b"other"
    assert 0 < redis_client.ttl(KEYS.state(req.id)) <= TTL


def test_publish_is_fenced_idempotent_and_acks_with_the_terminal_event(redis_client, job):
    req, stream, eid = job
    epoch = claim(redis_client, req.id)[0]
    assert publish(redis_client, req.id, stream, eid, epoch, 0, [5, 6]) == [1, 0]
    assert publish(redis_client, req.id, stream, eid, epoch, 0, [5, 6, 7]) == [1, 0]  # a retry
    assert out_tokens(redis_client, req.id) == [(1, [5]), (2, [6]), (3, [7])]
    assert publish(redis_client, req.id, stream, eid, epoch, 5, [9]) == [-1, 0]  # a gap
    redis_client.hset(KEYS.state(req.id), "cancel", "1")
    assert publish(redis_client, req.id, stream, eid, epoch, 3, [8]) == [1, 1]  # cancel seen
    assert publish(redis_client, req.id, stream, eid, epoch + 1, 4, [9]) == [0, 0]  # fenced
    assert redis_client.xpending(stream, GROUP)["pending"] == 1
    assert publish(redis_client, req.id, stream, eid, epoch, 4, [9], terminal=True) == [1, 1]
    assert redis_client.xpending(stream, GROUP)["pending"] == 0 and redis_client.xlen(stream) == 0
    assert publish(redis_client, req.id, stream, eid, epoch, 5, [10]) == [0, 0]  # done
    assert [s for s, _ in out_tokens(redis_client, req.id)] == [1, 2, 3, 4, 5]


def test_renew_returns_the_jobs_no_longer_owned(redis_client, job):
    req, stream, eid = job
    other = build_request([3])
    eid2 = redis_client.xadd(stream, job_fields(other)).decode()
    redis_client.xreadgroup(GROUP, "w", {stream: ">"})
    epoch = claim(redis_client, req.id)[0]
    claim(redis_client, other.id)
    claim(redis_client, other.id, "thief")  # the second job's epoch moved on
    lost = redis_client.register_script(RENEW)(
        keys=[stream, KEYS.state(req.id), stream, KEYS.state(other.id)],
        args=[GROUP, "w", eid, epoch, eid2, 1])
    assert [int(i) for i in lost] == [2]


def test_handback_requeues_at_the_tail_and_fences_the_owner(redis_client, job):
    req, stream, eid = job
    epoch = claim(redis_client, req.id)[0]
    args = [epoch, GROUP, eid, TTL]
    for k, v in job_fields(req).items():
        args += [k, v]
    handback = redis_client.register_script(HANDBACK)
    assert handback(keys=[KEYS.state(req.id), stream], args=args) == 1
    assert handback(keys=[KEYS.state(req.id), stream], args=args) == 0  # fenced out now
    (new_id, fields), = redis_client.xrange(stream)
    assert new_id.decode() != eid and fields == job_fields(req)
    assert redis_client.xpending(stream, GROUP)["pending"] == 0
    assert claim(redis_client, req.id, "next")[:2] == [epoch + 2, 1]  # not a new delivery


def test_cancel_ends_an_unowned_job_and_flags_an_owned_one(redis_client, job):
    req, stream, eid = job
    cancel = redis_client.register_script(CANCEL)
    queued = build_request([9])
    assert cancel(**cancel_call(KEYS, queued.id, TTL)) == 2  # nobody holds it: ended here
    (_, fields), = redis_client.xrange(KEYS.out(queued.id))
    assert decode_event(fields).type == CANCELLED and int(fields[b"seq"]) == 1
    assert cancel(**cancel_call(KEYS, queued.id, TTL)) == 0  # already done
    claim(redis_client, req.id)
    assert cancel(**cancel_call(KEYS, req.id, TTL)) == CANCEL_FLAGGED == 1
    assert redis_client.hget(KEYS.state(req.id), "cancel") == b"1"
    assert redis_client.xlen(KEYS.out(req.id)) == 0  # its worker writes the terminal event


def test_the_runner_reloads_scripts_redis_forgot(redis_db, redis_client, job):
    req, stream, eid = job
    ev = encode_event(Event(type=TOKENS, request_id=req.id, token_ids=[4]))

    async def scenario():
        r = redis.asyncio.Redis.from_url(redis_db)
        claim_script, publish_script = LuaScript(CLAIM), LuaScript(PUBLISH)
        first = await claim_script(r, [KEYS.state(req.id)], ["w", TTL])
        await r.script_flush()  # a Redis restart or SCRIPT FLUSH
        second = await claim_script(r, [KEYS.state(req.id)], ["w", TTL])
        await publish_script.load(r)
        await r.script_flush()  # now NOSCRIPT inside a pipeline
        replies = await run_calls(r, [(publish_script,
                                       [KEYS.state(req.id), KEYS.out(req.id), stream],
                                       [2, TTL, GROUP, eid, 0, 0, ev])])
        await r.aclose()
        return first, second, replies

    first, second, replies = asyncio.run(scenario())
    assert [int(first[0]), int(second[0])] == [1, 2]
    assert [int(x) for x in replies[0]] == [1, 0]
    assert out_tokens(redis_client, req.id) == [(1, [4])]
