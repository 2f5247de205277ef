"""Checkpoints: the worker's hash, the queue's stats, their TTLs, the metrics endpoint, the
clean-stop removal, and the consumer names they hold."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from pathlib import Path

import redis

from pagedq.client import Client, SamplingParams
from pagedq.client.protocol import GROUP, Keys
from pagedq.worker.config import WorkerConfig
from pagedq.worker.service.checkpoints import Checkpoints, Rate, claim_name
from pagedq.worker.service.metrics_server import Metrics
from pagedq.worker.service.shared import Shared
from tests.service.harness import ENGINE, running_worker, wait_until


def test_checkpoint_keys_metrics_and_cleanup(redis_db, redis_client, model):
    keys = Keys()
    with running_worker(redis_db, model, "ck", metrics_port=0, ttl=120) as worker, \
            Client(redis_db) as client:
        h = client.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=8))
        h.result(timeout=30)

        def settled():
            w = client.stats()["workers"][0]
            return w["generated_tokens"] >= 8 and w["kv_blocks_used"] == 0 and w["running"] == 0

        wait_until(settled)  # the idle engine's stats reach the next checkpoint
        info = client.stats()["workers"][0]
        assert info["name"] == "ck" and info["kv_blocks_total"] == ENGINE["num_kv_blocks"]
        assert info["waiting"] == 0 and info["jobs"] == 0 and info["state"] == "serving"
        assert info["generated_tokens"] == 8 and info["kv_tokens_live"] == 0
        assert "num_generated_tokens" not in info  # one count of generated tokens, not two
        assert {"heartbeat", "kv_tokens_live", "preemptions", "tokens_per_s"} <= info.keys()
        assert 0 < redis_client.pttl(keys.worker("ck")) <= 5000
        assert 0 < redis_client.pttl(keys.stats) <= 5000
        assert 0 < redis_client.ttl(keys.out(h.id)) <= 120
        assert 0 < redis_client.ttl(keys.state(h.id)) <= 120
        base = f"http://127.0.0.1:{worker.metrics_port}"
        text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_bucket",
                     "vllm:inter_token_latency_seconds_count", 'finished_reason="length"'):
            assert name in text
        assert 'model_name="' + Path(model).name + '"' in text and model not in text
        assert urllib.request.urlopen(base + "/healthz", timeout=5).status == 200
        slow = socket.create_connection(("127.0.0.1", worker.metrics_port))  # sends nothing
        assert urllib.request.urlopen(base + "/healthz", timeout=5).status == 200
        with socket.create_connection(("127.0.0.1", worker.metrics_port)) as huge:
            huge.sendall(b"GET /" + b"x" * 70_000 + b" HTTP/1.1\r\n\r\n")
            assert huge.recv(64).startswith(b"HTTP/1.0 414")  # an answer, not a traceback
        slow.close()
    assert not redis_client.exists(keys.worker("ck"))
    assert redis_client.zrange(keys.workers, 0, -1) == []


def test_consumer_names_are_stable_and_unique(redis_db):
    async def scenario():
        r = redis.asyncio.Redis.from_url(redis_db)
        keys = Keys()
        first = await claim_name(r, keys, "host", 5.0)
        second = await claim_name(r, keys, "host", 5.0)  # "host" is live: suffixed
        third = await claim_name(r, keys, "host", 5.0)
        await r.delete(keys.lock("host"))  # its worker stopped cleanly (or its lock expired)
        again = await claim_name(r, keys, "host", 5.0)
        ttl = await r.pttl(keys.lock("host"))
        await r.aclose()
        return first, second, third, again, ttl

    first, second, third, again, ttl = asyncio.run(scenario())
    assert (first, second, third, again) == ("host", "host-2", "host-3", "host")
    assert 0 < ttl <= 5000


def test_the_stats_hash_agrees_with_client_stats(redis_db, redis_client):
    """Both read the queue depth with the same function: the checkpoint's flat hash and the
    client's nested stats show the same numbers."""
    keys = Keys()
    for stream in keys.all_jobs():
        redis_client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    with Client(redis_db) as client:
        client.submit_many([[1], [2], [3]], SamplingParams(), priority=-1)
        client.submit([4], SamplingParams(), priority=1)
        redis_client.xreadgroup(GROUP, "someone", {keys.jobs("low"): ">"}, count=2)
        redis_client.xadd(keys.dead, {"x": "1"})
        stats = client.stats()

    async def scenario():
        r = redis.asyncio.Redis.from_url(redis_db)
        metrics = Metrics("m")
        shared = Shared(WorkerConfig(checkpoint_interval=1.0), None, metrics)
        checkpoints = Checkpoints(shared, r, keys, "w", "m")
        await checkpoints.write()
        await r.aclose()
        return metrics.queue

    queue = asyncio.run(scenario())
    stored = {k.decode(): float(v) for k, v in redis_client.hgetall(keys.stats).items()}
    for level, counts in stats["levels"].items():
        for name, value in counts.items():
            assert stored[f"{name}_{level}"] == queue[f"{name}_{level}"] == value
    assert stats["levels"]["low"] == {"length": 3, "pending": 2, "lag": 1}
    assert stored["depth"] == stats["depth"] == 2 and stored["pending"] == stats["pending"] == 2
    assert stored["dead_letters"] == stats["dead_letters"] == 1
    assert redis_client.hget(keys.worker("w"), "state") == b"serving"


def test_tokens_per_s_is_steady_when_tokens_arrive_in_bursts():
    """Bug: tokens_per_s flickered between 0 and the real rate (publishes come in bursts, the
    checkpoint took the change since the previous one)."""
    rate = Rate(window_s=10.0)
    count, seen = 0, []
    for second in range(60):
        if second % 2 == 0:
            count += 200  # one burst every 2 s: 100 tokens/s
        seen.append(rate.update(count, now=float(second)))
    assert all(90 <= r <= 111 for r in seen[12:]), seen


def test_the_start_claim_is_withdrawn_when_the_announcer_loses_a_cancel(redis_db, redis_client):
    """Python 3.11's wait_for (inside redis-py) can drop a cancel: stop() then waited forever
    for the announcing task, and the worker never became ready (a CI hang)."""
    from redis.asyncio import Redis

    from pagedq.worker.service.checkpoints import Starting

    async def main():
        r = Redis.from_url(redis_db)
        starting = Starting(r, Keys(), ttl_s=30, interval_s=0.01)
        announce, lost = starting._announce, [0]

        async def loses_its_first_cancel():
            while True:
                try:
                    await announce()
                except asyncio.CancelledError:
                    lost[0] += 1
                    if lost[0] > 1:
                        raise
                    asyncio.current_task().uncancel()

        starting._announce = loses_its_first_cancel
        starting.start()
        while not await r.exists(Keys().starting):
            await asyncio.sleep(0.01)
        stop = asyncio.ensure_future(starting.stop())
        done, _ = await asyncio.wait([stop], timeout=20)  # a hang's bound, not a speed figure
        if not done:  # the old single cancel: end the loop so the test can report it
            lost[0] = 10
            stop.cancel()
        await r.aclose()
        return bool(done), lost[0]

    assert asyncio.run(main()) == (True, 2)
    assert not redis_client.exists(Keys().starting)
