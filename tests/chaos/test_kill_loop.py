"""Workers killed in a loop: SIGKILL a random worker of three every few seconds while greedy,
seeded and n=2 jobs run. Every job ends exactly once with the in-process engine's tokens, and
none is dead-lettered: a job whose workers died under it is only a suspect, run alone."""

from __future__ import annotations

import random
import time

import pytest
import redis

from pagedq.client.protocol import Keys
from tests.chaos.harness import (
    Fleet,
    Submitter,
    audit,
    expected_tokens,
    report,
    wait_serving,
    workload,
)
from tests.chaos.servers import RedisServer

NAMES = ["k1", "k2", "k3"]
PROFILES = {  # jobs, seconds of killing, seconds between kills
    "short": (45, 30.0, (4.0, 8.0)),
    "long": (600, 300.0, (5.0, 15.0)),
}


@pytest.mark.timeout(1800)
def test_killing_workers_in_a_loop_loses_nothing(tmp_path, tiny_model_dir, profile):
    count, kill_for, gap = PROFILES[profile]
    model = str(tiny_model_dir("llama"))
    jobs = workload(count, seed=17, max_tokens=(100, 240))
    expected = expected_tokens(model, jobs)
    server = RedisServer(tmp_path / "redis").start()
    keys = Keys("killloop")
    fleet = Fleet(server.url, model, keys.queue, tmp_path, "--reclaim-after", "3",
                  "--checkpoint-interval", "0.5", "--drain-timeout", "2")
    rng = random.Random(5)
    try:
        for name in NAMES:
            fleet.spawn(name)
        with redis.Redis.from_url(server.url) as r:
            wait_serving(r, keys, NAMES)
            sub = Submitter(server.url, keys.queue, jobs, rate=count / (kill_for * 0.9),
                            timeout=900).start()
            end = time.monotonic() + kill_for
            while time.monotonic() < end:
                time.sleep(rng.uniform(*gap))
                victim = rng.choice(NAMES)
                fleet.kill(victim)
                # restarted under its name, it takes its jobs back: once the dead one's claim on
                # the name has expired (before that a new worker takes "NAME-2", by design)
                lock_free = time.monotonic() + 30
                while r.exists(keys.lock(victim)) and time.monotonic() < lock_free:
                    time.sleep(0.1)
                fleet.spawn(victim)
            assert sub.join(1200), "results still outstanding"
            result = audit(r, keys, jobs, expected, model=model)
            dead = r.xlen(keys.dead)
            pending = sum(r.xlen(s) for s in keys.all_jobs())
            redelivered = sum(int(r.hget(keys.state(j.id), "deliveries") or 0) > 1 for j in jobs)
            wait_serving(r, keys, NAMES, fleet=fleet)
        crashed = fleet.crashed()
        codes = fleet.stop()
    finally:
        fleet.stop()
        server.stop()
    report(f"kill_loop[{profile}]", jobs=count, kills=fleet.kills, redelivered=redelivered,
           exact=result.done, lost=result.lost, duplicated=result.duplicated,
           mismatched=result.mismatched, flipped=result.flipped, failed=result.failed,
           dead_lettered=dead)
    assert not crashed, crashed
    assert result.clean, (str(result), result.problems[:5])
    assert dead == 0 and pending == 0
    assert set(codes.values()) == {0}  # the survivors drain cleanly
