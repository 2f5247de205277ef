"""The consumer: XAUTOCLAIM's two reply shapes, and entries deleted while pending."""

from __future__ import annotations

import asyncio

import redis

from pagedq.client.protocol import GROUP, Keys


def test_parse_autoclaim_both_reply_shapes(redis_client):
    from pagedq.worker.service.consumer import parse_autoclaim

    s = "pq-test"
    redis_client.xgroup_create(s, GROUP, id="0", mkstream=True)
    a = redis_client.xadd(s, {"k": "1"})
    b = redis_client.xadd(s, {"k": "2"})
    redis_client.xreadgroup(GROUP, "c1", {s: ">"})
    redis_client.xdel(s, a)  # deleted while pending
    redis_client.response_callbacks.pop("XAUTOCLAIM", None)
    reply = redis_client.execute_command("XAUTOCLAIM", s, GROUP, "c2", 0, "0-0")
    cursor, entries, deleted, nils = parse_autoclaim(reply)
    assert cursor == "0-0" and entries == [(b.decode(), {b"k": b"2"})]
    version = int(redis_client.info()["redis_version"].split(".")[0])
    if version >= 7:
        assert deleted == [a.decode()] and nils == 0
    else:  # 6.2: a bare nil per deleted entry
        assert deleted == [] and nils == 1
    seven = [b"0-0", [[b"5-0", [b"k", b"v"]]], [b"4-0"]]
    assert parse_autoclaim(seven) == ("0-0", [("5-0", {b"k": b"v"})], ["4-0"], 0)
    six = [b"0-0", [None, [b"5-0", [b"k", b"v"]]]]
    assert parse_autoclaim(six) == ("0-0", [("5-0", {b"k": b"v"})], [], 1)


def test_reclaim_acks_entries_deleted_while_pending(redis_db, redis_client):
    """Whatever the server version, a pending entry that was deleted is found and acked."""
    from pagedq.worker.service.consumer import Consumer

    keys = Keys()

    async def scenario():
        r = redis.asyncio.Redis.from_url(redis_db)
        ghost, me = Consumer(r, keys, "ghost"), Consumer(r, keys, "me")
        await ghost.ensure_groups()
        stream = keys.jobs("normal")
        gone = (await r.xadd(stream, {"k": "1"})).decode()
        kept = (await r.xadd(stream, {"k": "2"})).decode()
        await ghost.read(10, 0)
        await r.xdel(stream, gone)
        entries = await me.reclaim(10, 0)
        for e in entries:
            if e.fields is None:
                await me.ack_delete(e.stream, e.entry_id)
        pending = await r.xpending(stream, GROUP)
        await r.aclose()
        return entries, pending, gone, kept

    entries, pending, gone, kept = asyncio.run(scenario())
    assert {(e.entry_id, e.fields is None) for e in entries} == {(gone, True), (kept, False)}
    assert pending["pending"] == 1


def test_a_burst_that_wakes_an_idle_reader_is_taken_whole(redis_db):
    """Jobs submitted together (one MULTI) while the worker waits are read in one call, in
    priority order, so they start in the same engine step."""
    from pagedq.worker.service.consumer import Consumer

    keys = Keys()

    async def scenario():
        r = redis.asyncio.Redis.from_url(redis_db)
        consumer = Consumer(r, keys, "me")
        await consumer.ensure_groups()
        reading = asyncio.create_task(consumer.read(8, 5000))
        await asyncio.sleep(0.3)  # the reader is blocked on empty streams
        pipe = r.pipeline(transaction=True)
        for level, k in (("low", "1"), ("normal", "2"), ("high", "3"), ("normal", "4")):
            pipe.xadd(keys.jobs(level), {"k": k})
        await pipe.execute()
        entries = await asyncio.wait_for(reading, 10)
        await r.aclose()
        return [e.fields[b"k"] for e in entries]

    taken = asyncio.run(scenario())
    assert sorted(taken) == [b"1", b"2", b"3", b"4"]
    assert taken[1:] == sorted(taken[1:], key=lambda k: {b"3": 0, b"2": 1, b"4": 1, b"1": 2}[k])
