"""The queue's shared commands and replies: group creation, enqueueing, reply shapes, and the
one depth function clients and workers both read."""

from __future__ import annotations

import pytest
import redis

from pagedq.client.protocol import GROUP, Keys, build_request, decode_request
from pagedq.client.queue import (
    DEPTH_REPLIES,
    check_groups,
    create_groups,
    depth_query,
    enqueue,
    parse_entries,
    queue_depth,
    stream_replies,
)

KEYS = Keys("q")


def run(r, query, *args, raise_on_error=True):
    pipe = r.pipeline(transaction=False)
    query(pipe, *args)
    return pipe.execute(raise_on_error=raise_on_error)


def test_group_creation_is_idempotent_and_reads_from_the_start(redis_client):
    redis_client.xadd(KEYS.jobs("low"), {"early": "1"})  # enqueued before any group existed
    for _ in range(2):
        check_groups(run(redis_client, create_groups, KEYS, raise_on_error=False))
    for stream in KEYS.all_jobs():
        (group,) = redis_client.xinfo_groups(stream)
        assert group["name"] == GROUP.encode()
    reply = redis_client.xreadgroup(GROUP, "c", {KEYS.jobs("low"): ">"})
    assert [f for _, f in parse_entries(reply)] == [{b"early": b"1"}]


def test_group_creation_raises_any_other_error(redis_client):
    redis_client.set(KEYS.jobs("high"), "not a stream")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        check_groups(run(redis_client, create_groups, KEYS, raise_on_error=False))


def test_enqueue_writes_each_request_on_its_level(redis_client):
    reqs = [build_request([1], priority=p) for p in (3, 0, -2, 0)]
    run(redis_client, enqueue, KEYS, reqs)
    got = {level: [decode_request(f[b"p"]).id for _, f in redis_client.xrange(KEYS.jobs(level))]
           for level in ("high", "normal", "low")}
    assert got == {"high": [reqs[0].id], "normal": [reqs[1].id, reqs[3].id],
                   "low": [reqs[2].id]}


def test_queue_depth_arithmetic():
    replies = [5, {"pending": 2}, 0, {"pending": 0}, 3, redis.ResponseError("NOGROUP"), 7]
    assert len(replies) == DEPTH_REPLIES
    assert queue_depth(replies) == {
        "depth": 6, "pending": 2, "dead_letters": 7,
        "levels": {"high": {"length": 5, "pending": 2, "lag": 3},
                   "normal": {"length": 0, "pending": 0, "lag": 0},
                   "low": {"length": 3, "pending": 0, "lag": 3}}}
    # a pending count above the length (entries deleted while pending) never makes lag < 0
    assert queue_depth([1, {"pending": 4}, 0, {}, 0, {}, "?"])["levels"]["high"]["lag"] == 0
    assert queue_depth([redis.ResponseError("x")] * DEPTH_REPLIES)["depth"] == 0


def test_queue_depth_against_redis(redis_client):
    check_groups(run(redis_client, create_groups, KEYS, raise_on_error=False))
    run(redis_client, enqueue, KEYS, [build_request([i], priority=-1) for i in range(4)])
    redis_client.xreadgroup(GROUP, "c", {KEYS.jobs("low"): ">"}, count=3)
    depth = queue_depth(run(redis_client, depth_query, KEYS))
    assert depth["levels"]["low"] == {"length": 4, "pending": 3, "lag": 1}
    assert (depth["depth"], depth["pending"], depth["dead_letters"]) == (1, 3, 0)


def test_stream_replies_under_resp2_and_resp3():
    entries = [(b"1-0", {b"k": b"v"})]
    assert stream_replies([[b"s", entries]]) == [(b"s", entries)]
    assert stream_replies({b"s": [entries]}) == [(b"s", entries)]
    assert stream_replies(None) == [] and stream_replies({}) == []
    assert parse_entries({b"s": [entries]}) == [("1-0", {b"k": b"v"})]
