"""The worker's Redis link: redis-py's Retry rides an outage, which is logged once; at
start-up an unreachable Redis is a configuration error (exit 1), and no URL starts an
embedded server."""

from __future__ import annotations

import asyncio
import time

import pytest
from structlog.testing import capture_logs

from pagedq.client.connection import redact_url
from pagedq.embedded_redis import EmbeddedRedis, free_port
from pagedq.worker.config import WorkerConfig
from pagedq.worker.service import redis_link
from pagedq.worker.service.redis_link import RedisLink
from pagedq.worker.service.worker import Worker

DOWN = "Redis unreachable; every call waits and retries until it is back"
UP = "Redis reachable again"


def ride_outage(tmp_path, calls: int, stagger_s: float, settle_s: float):
    """Redis stops with ``calls`` connections idle in the link's pool; ``calls`` reads start
    ``stagger_s`` apart while it is down, ``settle_s`` passes, and it comes back (the same data,
    AOF). Returns whether the link was down with every call waiting, the values read, whether
    it is still down after, and the log's events."""
    port = free_port()
    server = EmbeddedRedis.start(port=port, workdir=str(tmp_path), appendonly=True)

    async def scenario():
        link = await RedisLink.open(server.url)
        await asyncio.gather(*(link.redis.set(f"k{i}", "v") for i in range(calls)))
        server.stop()
        tasks = []
        for i in range(calls):
            tasks.append(asyncio.create_task(link.redis.get(f"k{i}")))
            await asyncio.sleep(stagger_s)
        await asyncio.sleep(settle_s)
        waiting = link.outage.down and not any(t.done() for t in tasks)
        restarted = EmbeddedRedis.start(port=port, workdir=str(tmp_path), appendonly=True,
                                        password=server.password)
        try:
            values = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            return waiting, values, link.outage.down
        finally:
            await link.close()
            restarted.stop()

    with capture_logs() as logs:
        waiting, values, still_down = asyncio.run(scenario())
    return waiting, values, still_down, [e["event"] for e in logs]


def test_an_outage_is_waited_out_and_logged_once(tmp_path):
    waiting, values, still_down, events = ride_outage(tmp_path, 3, 0.0, 1.0)
    assert waiting and values == [b"v"] * 3 and not still_down
    assert events.count(DOWN) == 1 and events.count(UP) == 1
    assert events.index(DOWN) < events.index(UP)


def test_unreachable_redis_at_start_exits_1(monkeypatch):
    monkeypatch.setattr(redis_link, "CONNECT_TIMEOUT_S", 0.5)
    worker = Worker(WorkerConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0"))
    began = time.monotonic()
    assert asyncio.run(worker.run()) == 1
    assert time.monotonic() - began < 10
    assert worker.engine is None  # it gave up before loading the model


def test_no_url_starts_an_embedded_server():
    async def scenario():
        link = await RedisLink.open(None)
        try:
            assert link.embedded is not None and link.url == redact_url(link.embedded.url)
            assert await link.redis.ping()
            return link.embedded
        finally:
            await link.close()

    embedded = asyncio.run(scenario())
    assert embedded.process.poll() is not None  # closing the link stopped it


@pytest.mark.parametrize("copies", [1, 3])
def test_every_copy_of_the_retry_reports_to_one_outage(copies):
    import copy

    outage = redis_link.Outage("redis://x")
    retries = [copy.deepcopy(redis_link.RetryForever(outage)) for _ in range(copies)]
    assert all(r.outage is outage for r in retries)


def test_idle_pooled_connections_end_no_outage_early(tmp_path):
    """Calls that start one by one during an outage take the pool's idle connections, whose
    sockets are not yet seen closed: their connect has nothing to do and proves nothing, so
    the outage is logged once, and ends when Redis is back."""
    waiting, values, still_down, events = ride_outage(tmp_path, 4, 0.2, 0.0)
    assert waiting and values == [b"v"] * 4 and not still_down
    assert events.count(DOWN) == 1 and events.count(UP) == 1, events


def test_loading_replies_count_as_no_outage():
    """A restarted server reading its AOF accepts connections and answers LOADING: it is up,
    so its calls wait without an outage (logged once as loading)."""
    from redis.exceptions import BusyLoadingError

    outage = redis_link.Outage("redis://x")
    with capture_logs() as logs:
        for failures in range(1, 5):
            outage.saw(BusyLoadingError("LOADING Redis is loading the dataset in memory"),
                       failures)
    assert not outage.down
    assert [e["event"] for e in logs] == ["Redis is loading its data set; calls wait until it "
                                          "has loaded"]
