"""The asyncio client against a real Redis and a worker: the same protocol as the blocking one."""

from __future__ import annotations

import asyncio

import pytest

from pagedq.client import AsyncClient, RequestCancelledError, SamplingParams
from pagedq.client.protocol import F_EVENT, F_SEQ, FINISHED, TOKENS, Event, Keys, encode_event
from pagedq.client.reader import STREAMS_PER_READ
from pagedq.worker.cli.queue_commands import render_stats
from tests.service.harness import running_worker


def test_async_client_end_to_end(redis_db, tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    params = SamplingParams(temperature=0, max_tokens=6)

    async def scenario():
        async with AsyncClient(redis_db) as client:
            h = await client.submit([1, 4, 9], params)
            streamed = [e async for e in h.stream(timeout=60)]
            res = await h.result(timeout=5)
            many = await client.generate([[2, 3], [4, 5, 6]], params, timeout=60)
            long = await client.submit([3, 3], SamplingParams(max_tokens=200, ignore_eos=True))
            async for _ in long.stream(timeout=60):
                break
            assert await long.cancel()
            with pytest.raises(RequestCancelledError):
                await long.result(timeout=30)
            stats = await client.stats()
            return streamed, res, many, stats

    with running_worker(redis_db, model, "aw"):
        streamed, res, many, stats = asyncio.run(scenario())
    assert [t for e in streamed for t in e.token_ids] == res.token_ids and len(res.token_ids) == 6
    assert [len(r.token_ids) for r in many] == [6, 6]
    assert stats["workers"][0]["name"] == "aw"
    table = render_stats(stats)
    assert "aw" in table and "normal" in table


def test_ten_thousand_handles_in_flight_share_a_few_connections(redis_db, redis_client):
    """Bug: above 100 concurrent stream()/result() calls redis-py's pool raised
    MaxConnectionsError and left the jobs orphaned. All of one client's handles are read through
    a few multiplexed XREADs: 10,000 in flight hold about ten connections."""
    n = 10_000
    keys = Keys()

    def finish_all(ids):
        pipe = redis_client.pipeline(transaction=False)
        for k, rid in enumerate(ids):
            tokens = Event(TOKENS, rid, token_ids=[k % 300, 7], position=2, finish_reason="length")
            pipe.xadd(keys.out(rid), {F_SEQ: 1, F_EVENT: encode_event(tokens)})
            done = Event(FINISHED, rid, finish_reasons=["length"])
            pipe.xadd(keys.out(rid), {F_SEQ: 2, F_EVENT: encode_event(done)})
            if len(pipe) >= 2000:
                pipe.execute()
        pipe.execute()

    async def scenario():
        before = redis_client.info("clients")["connected_clients"]
        async with AsyncClient(redis_db) as client:
            ids = [f"many-{k}" for k in range(n)]
            tasks = [asyncio.create_task(client.handle(rid).result(timeout=120)) for rid in ids]
            reader = await client.reader()
            while reader.open_streams < n:
                await asyncio.sleep(0.05)
            during = redis_client.info("clients")["connected_clients"] - before
            await asyncio.to_thread(finish_all, ids)
            results = await asyncio.gather(*tasks)
            left = reader.open_streams
        return ids, results, during, left

    ids, results, during, left = asyncio.run(scenario())
    assert [r.request_id for r in results] == ids
    assert [r.token_ids for r in results] == [[k % 300, 7] for k in range(n)]
    assert during <= n // STREAMS_PER_READ + 4, during
    assert left == 0  # every handle let go of its stream


def test_concurrent_first_submits_all_land(redis_db, redis_client):
    async def scenario():
        async with AsyncClient(redis_db) as client:
            return await asyncio.gather(*(client.submit([1, k]) for k in range(200)))

    handles = asyncio.run(scenario())
    assert len({h.id for h in handles}) == 200
    assert redis_client.xlen(Keys().jobs("normal")) == 200


def test_calls_beyond_the_pool_wait_for_a_connection(redis_db, redis_client, monkeypatch):
    """With a pool of 2 connections, 60 concurrent submits must queue for them, whatever the
    CPU's speed (with 100 connections, 200 submits overflowed redis-py 8's own pool only on a
    fast CPU): none fails, every job lands, and the client never held more than 2."""
    from pagedq.client import connection

    monkeypatch.setattr(connection, "POOL_CONNECTIONS", 2)

    db = redis_client.connection_pool.connection_kwargs.get("db", 0)
    me = redis_client.client_id()

    async def scenario():
        async with AsyncClient(redis_db) as client:
            handles = await asyncio.gather(*(client.submit([2, k]) for k in range(60)))
            opened = [c for c in redis_client.client_list()  # the server's own count
                      if int(c["db"]) == db and int(c["id"]) != me]
            return handles, len(opened)

    handles, opened = asyncio.run(scenario())
    assert len({h.id for h in handles}) == 60
    assert redis_client.xlen(Keys().jobs("normal")) == 60
    assert 1 <= opened <= 2


def test_a_read_that_began_past_a_readers_cursor_hands_it_nothing():
    """Two readers of one stream, one further along: an XREAD that began at the further
    reader's cursor returns entries after a gap for the other, which takes none of them (the
    next read starts from its cursor) rather than skip events."""
    from pagedq.client.reader import Shard, StreamReader, Subscription

    async def scenario():
        shard = Shard(StreamReader(Keys("q"), None), 0)
        ahead = Subscription("k", "5-0", shard)
        behind = Subscription("k", "1-0", shard)
        shard.subs["k"] = [ahead, behind]
        assert shard.streams()["k"] == "1-0"  # the next read starts from the one behind
        shard._dispatch([[b"k", [(b"6-0", {}), (b"7-0", {})]]], {"k": "5-0"})
        assert [e[0] for e in ahead.batches.get_nowait()] == ["6-0", "7-0"]
        assert behind.batches.empty() and behind.cursor == "1-0"
        shard._dispatch([[b"k", [(b"2-0", {}), (b"6-0", {}), (b"7-0", {})]]], {"k": "1-0"})
        assert [e[0] for e in behind.batches.get_nowait()] == ["2-0", "6-0", "7-0"]
        assert ahead.batches.empty()  # nothing it had already

    asyncio.run(scenario())
