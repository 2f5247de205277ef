"""Soak: many short jobs through two workers, from one AsyncClient holding them all in flight.

Sampled along the way: each worker's RSS and Redis's memory. After the TTL every per-request
key has expired and the job streams are empty; the workers' RSS is flat (a plateau, not a
leak): the last quarter of the run adds at most 10% over the first quarter's level.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import redis

from pagedq.client import AsyncClient, SamplingParams
from pagedq.client.protocol import GROUP, Keys
from tests.chaos.harness import Fleet, report, wait_serving
from tests.chaos.servers import RedisServer

PROFILES = {"short": (300, 5), "long": (10_000, 30)}  # jobs, request TTL (s)


@pytest.mark.timeout(3600)
def test_soak_leaves_no_keys_and_flat_memory(tmp_path, tiny_model_dir, profile):
    count, ttl = PROFILES[profile]
    model = str(tiny_model_dir("llama"))
    server = RedisServer(tmp_path / "redis").start()
    keys = Keys("soak")
    fleet = Fleet(server.url, model, keys.queue, tmp_path, "--ttl", str(ttl))
    samples: list[tuple[int, int, int]] = []  # (jobs done, worker RSS sum, Redis used memory)
    done = [0]
    try:
        for name in ("s1", "s2"):
            fleet.spawn(name)
        with redis.Redis.from_url(server.url) as r:
            wait_serving(r, keys, ["s1", "s2"])
            stop = threading.Event()
            sampler = threading.Thread(target=_sample, args=(fleet, r, done, samples, stop))
            sampler.start()
            results = asyncio.run(_run(server.url, keys.queue, count, done))
            stop.set()
            sampler.join()
            time.sleep(ttl + 2)
            request_keys = sum(1 for _ in r.scan_iter(match=f"{keys.base}:req:*", count=1000))
            streams = {s: r.xlen(s) for s in keys.all_jobs()}
            pending = sum(r.xpending(s, GROUP)["pending"] for s in keys.all_jobs())
            redis_mb = r.info("memory")["used_memory"] >> 20
        crashed = fleet.crashed()
    finally:
        fleet.stop()
        server.stop()
    quarter = [s for s in samples if s[0] >= count // 4] or samples
    first, last = quarter[0], samples[-1]
    report(f"soak[{profile}]", jobs=count, finished=sum(r.finish_reason == "length"
                                                        for r in results),
           rss_mb_first_quarter=first[1] >> 20, rss_mb_end=last[1] >> 20,
           redis_mb_peak=max(s[2] for s in samples) >> 20, redis_mb_after_ttl=redis_mb,
           request_keys_after_ttl=request_keys, stream_entries=sum(streams.values()))
    assert not crashed, crashed
    assert len(results) == count and all(len(r.token_ids) == 4 for r in results)
    assert request_keys == 0 and sum(streams.values()) == 0 and pending == 0
    if profile == "long":
        assert last[1] <= 1.1 * first[1], samples


async def _run(url: str, queue: str, count: int, done: list[int]) -> list:
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    async with AsyncClient(url, queue) as client:
        handles = []
        for start in range(0, count, 500):
            prompts = [[rng.randrange(3, 380) for _ in range(rng.randrange(3, 9))]
                       for _ in range(min(500, count - start))]
            handles += await client.submit_many(prompts, params)

        async def one(h):
            res = await h.result(timeout=1800)
            done[0] += 1
            return res

        return await asyncio.gather(*(one(h) for h in handles))


def _sample(fleet: Fleet, r, done: list[int], samples: list, stop: threading.Event) -> None:
    """Every second, and once more at the end (a short run may take less than a second)."""
    while True:
        rss = sum(fleet.rss(name) for name in fleet.procs)
        samples.append((done[0], rss, r.info("memory")["used_memory"]))
        if stop.wait(1.0):
            break
    samples.append((done[0], sum(fleet.rss(name) for name in fleet.procs),
                    r.info("memory")["used_memory"]))
